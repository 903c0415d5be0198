//! Fuzzes the client's `Link` pagination (`<url>; rel="next"`, tag lists and referrers).
//! Nothing may panic on any header values; a next page is found only where a link says
//! `rel=next`, and it is the link target resolved against the request URL.
#![no_main]

use ferry_registry_client::fuzz_api::next_link;
use libfuzzer_sys::fuzz_target;

const BASES: &[&str] = &[
    "https://registry.example.com/v2/library/app/tags/list?n=100",
    "http://127.0.0.1:5000/v2/_catalog",
    "https://ghcr.io/v2/org/app/referrers/sha256:0000000000000000000000000000000000000000000000000000000000000000",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let base = url::Url::parse(BASES[usize::from(selector) % BASES.len()]).expect("base URL");
    let values: Vec<&str> = text.split('\n').collect();
    let Some(next) = next_link(&values, &base) else {
        return;
    };
    // Which link part was taken: the first one marked next, in header order.
    let marked = values
        .iter()
        // The client reads only values that are visible ASCII (`to_str`).
        .filter(|v| http::HeaderValue::from_str(v).is_ok_and(|h| h.to_str().is_ok()))
        .flat_map(|v| v.split(','))
        .find_map(|part| {
            let part = part.trim();
            let (open, close) = (part.find('<')?, part.find('>')?);
            (close > open
                && part[close + 1..].split(';').any(|p| {
                    let p = p.trim().replace(' ', "");
                    p == "rel=\"next\"" || p == "rel=next"
                }))
            .then(|| &part[open + 1..close])
        })
        .expect("a next page needs a link marked rel=next");
    assert_eq!(base.join(marked).ok(), Some(next), "{text:?}");
});
