//! The crate's one error type.

/// What can go wrong in scheduling or simulating.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter outside what the model accepts.
    #[error("invalid {name}: {reason}")]
    Invalid {
        /// The parameter, as the command line spells it.
        name: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// The simulation ended with a live node still missing pieces: a scheduling bug,
    /// reported rather than hidden behind a figure.
    #[error("simulation stalled: node {node} still misses {missing} piece(s)")]
    Stalled {
        /// The first node found incomplete.
        node: usize,
        /// How many pieces it lacks.
        missing: usize,
    },
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(name: &'static str, reason: impl Into<String>) -> Error {
    Error::Invalid {
        name,
        reason: reason.into(),
    }
}
