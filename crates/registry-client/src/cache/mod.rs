//! Building blocks for callers that fetch through the [`Client`](crate::Client) and must
//! not fetch the same thing twice at once: [`flight::SingleFlight`] coalesces concurrent
//! calls for one key into one, and [`memory::MemoryCache`] keeps small documents
//! (manifests, tag lists, referrers indexes, index blobs) in a byte-bounded LRU that
//! remembers when each entry was last validated. The pull-through cache of ferry's
//! registry and the node daemon's index lookups use them. Neither knows what it holds.

pub mod flight;
pub mod memory;
