//! (being written)
use serde::{Deserialize, Serialize};
/// S3 backend settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct S3Config {
    pub bucket: String,
}
