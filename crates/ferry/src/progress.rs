//! Progress bars for long work, hidden when stderr is not a terminal.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-counting progress bar with a label.
pub fn bytes_bar(multi: &MultiProgress, label: &str, total: u64) -> ProgressBar {
    let bar = multi.add(ProgressBar::new(total));
    let style = ProgressStyle::with_template(
        "{msg:24} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(label.to_string());
    bar
}

/// A progress group drawing to stderr (nothing when stderr is not a terminal).
pub fn multi() -> MultiProgress {
    MultiProgress::with_draw_target(ProgressDrawTarget::stderr())
}
