//! # ferry-pull: `ferry pull` against containerd
//!
//! (Being written.)
