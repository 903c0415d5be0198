//! Building blocks for callers that must not fetch the same thing twice at once:
//! [`flight`] coalesces concurrent calls for one key into one ([`flight::Flights`] for
//! blocking callers such as ferry-fs's device, [`flight::SingleFlight`] on tokio), and
//! [`memory::MemoryCache`] keeps small documents (manifests, tag lists, referrers
//! indexes, index blobs) in a byte-bounded cache (on quick_cache) that remembers when
//! each entry was last validated. The pull-through cache of ferry's registry, the node
//! daemon's index lookups and the lazy filesystem's span fetches use them. Neither knows
//! what it holds.

pub mod flight;
pub mod memory;
