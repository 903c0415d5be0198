//! Fuzzes the startup-trace parser (a trace is fetched from the registry, so it comes
//! from strangers): arbitrary bytes must parse or fail cleanly within the limits, and
//! whatever parses must serialise back to a trace that parses the same.
#![no_main]

use ferry_fs::Trace;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(trace) = Trace::from_json(data) {
        let again = trace.to_json().expect("a parsed trace serialises");
        assert_eq!(Trace::from_json(&again).expect("its JSON parses"), trace);
    }
});
