//! ferry-pull's integration tests, one binary: each file a module (a binary per file
//! linked the whole workspace again for every one of them in CI's release build).

mod common;
mod lazy_or_present;
mod lazy_parity;
mod unpack;
