//! # ferry-p2p — who fetches which piece from whom
//!
//! This crate owns peer scheduling, as pure functions of their inputs:
//!
//! * **piece identity** ([`PieceId`]): a blob digest and a piece index; the unit peers
//!   schedule, serve and verify (in spans) while it arrives;
//! * **membership as an input** ([`Membership`]): the list of peers the caller knows of
//!   (static list, DNS or gossip — found elsewhere); rendezvous (HRW) scores rank them
//!   for every piece;
//! * **the tree of each piece** ([`PieceTree`]): the roots that fetch it from the
//!   registry, every other member's parent, the children each member serves (never more
//!   than the fan-out, whatever the fleet size), and the fallbacks after a parent fails;
//! * **the simulator** ([`sim`]) behind `ferry sim`, which drives the same functions
//!   through a discrete-event model of a fleet start.
//!
//! It must not open sockets, read clocks, spawn threads or touch files: time and
//! membership are inputs, so the daemon and the simulator call the same code and a test
//! can replay any decision.

mod error;
mod membership;
mod piece;
mod schedule;
pub mod sim;

pub use error::{Error, Result};
pub use membership::{Member, Membership, PeerId, hrw_score};
pub use piece::{PieceId, piece_count};
pub use schedule::{PieceTree, Schedule, Source, Topology};
