//! `ferry store plan`: which way should a fleet's nodes get an image — a full pull, a
//! lazy pull, a lazy pull prewarmed at boot, or a store baked into a volume snapshot —
//! from the image's sizes, the node's link and the prices a cloud charges.
//!
//! The model (docs/node-cache.md, "Choosing"), per node start, counts the seconds a node
//! waits for the image beyond a start from a local disk, what crosses the registry link,
//! and, for a baked store, the volume and snapshot storage; each option's monthly cost is
//! `starts × wait × node price + egress + storage`. Baking pays when
//!
//! ```text
//! starts × (wait_lazy − wait_baked) × node_price/3600 + starts × image_GB × egress_price
//!   > store_GB × (snapshot_price × versions_kept + volume_price × starts × node_hours/730.5)
//! ```
//!
//! It is arithmetic over its inputs, nothing measured here: defaults are ferry's own
//! figures (docs/benchmarks.md) and list prices, each printed with the result so a reader
//! sees what the answer rests on. It must not touch the store, the network or the clock.

use serde::Serialize;

/// Hours in an average month (365.25 × 24 / 12): cloud storage is priced per GB-month.
const HOURS_PER_MONTH: f64 = 730.5;
const GB: f64 = 1e9;

/// What the plan is computed from (the command line's flags, parsed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inputs {
    /// The image's compressed size (what a pull downloads).
    pub image_bytes: u64,
    /// Its size unpacked (what a pull writes).
    pub unpacked_bytes: u64,
    /// The bytes a start reads (a trace's hot set).
    pub hot_bytes: u64,
    /// Download throughput from the registry, bytes per second.
    pub link_bytes_per_s: u64,
    /// Unpack throughput to the node's disk, uncompressed bytes per second.
    pub write_bytes_per_s: u64,
    /// First-read throughput of a volume restored from a snapshot, with ferry's
    /// trace-ordered read-ahead (blocks arrive from object storage on first touch).
    pub volume_read_bytes_per_s: u64,
    /// One round trip to the registry, seconds.
    pub rtt_s: f64,
    /// Round trips a lazy start without a trace waits for, per MiB it reads.
    pub waits_per_mib: f64,
    /// Node starts (or image starts on fresh nodes) per month.
    pub starts_per_month: u64,
    /// Price of a node-hour.
    pub node_price_per_hour: f64,
    /// Price of a GB leaving the registry towards the node (0 inside a region).
    pub egress_price_per_gb: f64,
    /// Price of a GB-month of volume.
    pub volume_price_per_gb_month: f64,
    /// Price of a GB-month of snapshot.
    pub snapshot_price_per_gb_month: f64,
    /// Hours a node (and its volume) lives.
    pub node_hours: f64,
    /// Snapshots kept at once (image versions baked and still in use).
    pub versions_kept: u64,
}

/// One way of getting the image onto a node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Way {
    /// `pull`, `lazy`, `prewarm` or `baked`.
    pub name: &'static str,
    /// How the seconds are made up.
    pub how: String,
    /// Seconds a start waits for the image beyond a start from a local disk.
    pub wait_s: f64,
    /// Bytes from the registry per node start.
    pub registry_bytes: u64,
    /// Monthly price of the nodes' waiting.
    pub node_time_cost: f64,
    /// Monthly egress price.
    pub egress_cost: f64,
    /// Monthly storage price (baked only).
    pub storage_cost: f64,
    /// The sum.
    pub total: f64,
}

/// The plan: every option, the cheapest, and when baking starts to pay against the
/// best option that needs no volume.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// What it was computed from.
    pub inputs: Inputs,
    /// Every way, in the order pull, lazy, prewarm, baked.
    pub options: Vec<Way>,
    /// The way with the least monthly total.
    pub cheapest: &'static str,
    /// Starts per month from which the baked store costs less than the cheapest option
    /// without one (`None`: never, at these prices: each start would save nothing).
    pub baked_pays_from_starts: Option<u64>,
}

/// Bytes per MiB, for the round-trip rate.
const MIB: f64 = (1u64 << 20) as f64;

impl Inputs {
    fn secs(&self, bytes: u64, per_s: u64) -> f64 {
        bytes as f64 / per_s.max(1) as f64
    }

    /// The options' seconds and registry bytes per start, before prices.
    fn per_start(&self) -> Vec<(&'static str, String, f64, u64)> {
        let download = self.secs(self.image_bytes, self.link_bytes_per_s);
        let unpack = self.secs(self.unpacked_bytes, self.write_bytes_per_s);
        let hot = self.secs(self.hot_bytes, self.link_bytes_per_s);
        let waits = self.hot_bytes as f64 / MIB * self.waits_per_mib;
        let from_volume = self.secs(self.hot_bytes, self.volume_read_bytes_per_s);
        vec![
            (
                "pull",
                format!("download {download:.1}s + unpack {unpack:.1}s"),
                download + unpack,
                self.image_bytes,
            ),
            (
                // background fill brings the rest after the start: the whole image crosses
                "lazy",
                format!(
                    "hot set {hot:.1}s + {waits:.0} round trips × {:.0} ms",
                    self.rtt_s * 1e3
                ),
                hot + waits * self.rtt_s,
                self.image_bytes,
            ),
            (
                "prewarm",
                format!("hot set streamed at boot {hot:.1}s"),
                hot,
                self.image_bytes,
            ),
            (
                "baked",
                format!("hot set from the restored volume {from_volume:.1}s"),
                from_volume,
                0,
            ),
        ]
    }

    /// Monthly storage of the baked store: its snapshots, and a volume per node for the
    /// node's life. A ferry store keeps a layer's compressed bytes (spans verified by
    /// digest), so it is about the size of the image, not of its unpacked files.
    fn baked_storage(&self, starts: u64) -> f64 {
        let store_gb = self.image_bytes as f64 / GB;
        store_gb
            * (self.snapshot_price_per_gb_month * self.versions_kept as f64
                + self.volume_price_per_gb_month * starts as f64 * self.node_hours
                    / HOURS_PER_MONTH)
    }

    fn options_at(&self, starts: u64) -> Vec<Way> {
        self.per_start()
            .into_iter()
            .map(|(name, how, wait_s, registry_bytes)| {
                let node_time_cost = starts as f64 * wait_s * self.node_price_per_hour / 3600.0;
                let egress_cost =
                    starts as f64 * registry_bytes as f64 / GB * self.egress_price_per_gb;
                let storage_cost = if name == "baked" {
                    self.baked_storage(starts)
                } else {
                    0.0
                };
                Way {
                    name,
                    how,
                    wait_s,
                    registry_bytes,
                    node_time_cost,
                    egress_cost,
                    storage_cost,
                    total: node_time_cost + egress_cost + storage_cost,
                }
            })
            .collect()
    }

    /// The plan at these inputs.
    pub fn plan(&self) -> Plan {
        let options = self.options_at(self.starts_per_month);
        let cheapest = options
            .iter()
            .min_by(|a, b| a.total.total_cmp(&b.total))
            .map_or("pull", |o| o.name);
        Plan {
            inputs: self.clone(),
            baked_pays_from_starts: self.break_even(),
            options,
            cheapest,
        }
    }

    /// Least starts per month at which baking is cheaper than every other option. Each
    /// option's cost is linear in starts, so this is a division, not a search: the fixed
    /// snapshot cost over what each start saves.
    fn break_even(&self) -> Option<u64> {
        let total = |o: &Way| o.total;
        let one = self.options_at(1);
        let zero = self.options_at(0);
        let baked_fixed = zero.iter().find(|o| o.name == "baked").map(total)?;
        let baked_slope = one.iter().find(|o| o.name == "baked").map(total)? - baked_fixed;
        let best_other_slope = one
            .iter()
            .filter(|o| o.name != "baked")
            .map(total)
            .min_by(f64::total_cmp)?;
        let saved = best_other_slope - baked_slope;
        if saved <= 0.0 || !saved.is_finite() {
            return None;
        }
        let starts = (baked_fixed / saved).floor() + 1.0;
        (starts.is_finite() && starts < u64::MAX as f64).then_some(starts as u64)
    }
}

impl Plan {
    /// The plan as the table the command prints.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<8} {:>9} {:>11} {:>11} {:>11} {:>11}  how",
            "option", "wait", "node time", "egress", "storage", "per month"
        );
        for o in &self.options {
            let _ = writeln!(
                out,
                "{:<8} {:>8.1}s {:>11.2} {:>11.2} {:>11.2} {:>11.2}  {}",
                o.name, o.wait_s, o.node_time_cost, o.egress_cost, o.storage_cost, o.total, o.how
            );
        }
        let _ = writeln!(
            out,
            "cheapest at {} starts a month: {}",
            self.inputs.starts_per_month, self.cheapest
        );
        match self.baked_pays_from_starts {
            Some(n) => {
                let _ = writeln!(
                    out,
                    "a baked store pays from {n} starts a month (its snapshots cost the same at any count; each start saves what it waits less)"
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "a baked store never pays at these prices: a start from the volume costs no less than the best other option"
                );
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn inputs() -> Inputs {
        Inputs {
            image_bytes: 1_000_000_000,
            unpacked_bytes: 2_500_000_000,
            hot_bytes: 50 << 20,
            link_bytes_per_s: 100 << 20,
            write_bytes_per_s: 200 << 20,
            volume_read_bytes_per_s: 100 << 20,
            rtt_s: 0.001,
            waits_per_mib: 0.8,
            starts_per_month: 1000,
            node_price_per_hour: 1.0,
            egress_price_per_gb: 0.0,
            volume_price_per_gb_month: 0.08,
            snapshot_price_per_gb_month: 0.05,
            node_hours: 24.0,
            versions_kept: 4,
        }
    }

    fn option<'a>(plan: &'a Plan, name: &str) -> &'a Way {
        plan.options.iter().find(|o| o.name == name).unwrap()
    }

    #[test]
    fn a_pull_waits_for_download_and_unpack() {
        let plan = inputs().plan();
        let pull = option(&plan, "pull");
        let want = 1e9 / (100u64 << 20) as f64 + 2.5e9 / (200u64 << 20) as f64;
        assert!(
            (pull.wait_s - want).abs() < 1e-9,
            "{} vs {want}",
            pull.wait_s
        );
        // 1000 starts × wait × $1/h
        assert!((pull.node_time_cost - 1000.0 * want / 3600.0).abs() < 1e-9);
        assert_eq!(pull.storage_cost, 0.0);
    }

    #[test]
    fn lazy_pays_round_trips_that_prewarm_does_not() {
        let mut i = inputs();
        i.rtt_s = 0.020;
        let plan = i.plan();
        let lazy = option(&plan, "lazy");
        let prewarm = option(&plan, "prewarm");
        // 50 MiB at 0.8 waits per MiB = 40 round trips of 20 ms on top of the hot set
        assert!((lazy.wait_s - prewarm.wait_s - 40.0 * 0.020).abs() < 1e-9);
        assert_eq!(lazy.registry_bytes, i.image_bytes);
    }

    #[test]
    fn the_baked_store_pays_exactly_from_its_break_even() {
        let mut i = inputs();
        // a slow first read of the volume so that the answer is not trivially "always"
        i.volume_read_bytes_per_s = 80 << 20;
        i.egress_price_per_gb = 0.02;
        let n = i.plan().baked_pays_from_starts.unwrap();
        assert!(n > 1, "{n}");
        let cheaper = |starts: u64| {
            let mut j = i.clone();
            j.starts_per_month = starts;
            j.plan().cheapest == "baked"
        };
        assert!(cheaper(n), "baked is cheapest at the break-even {n}");
        assert!(
            !cheaper(n - 1),
            "baked is not cheapest below it ({})",
            n - 1
        );
    }

    #[test]
    fn a_volume_slower_than_the_link_never_pays_without_egress() {
        let mut i = inputs();
        i.volume_read_bytes_per_s = 10 << 20;
        let plan = i.plan();
        assert_eq!(plan.baked_pays_from_starts, None);
        assert_ne!(plan.cheapest, "baked");
        assert!(plan.table().contains("never pays"));
    }

    #[test]
    fn zero_rates_and_huge_sizes_give_numbers_not_panics() {
        let mut i = inputs();
        i.link_bytes_per_s = 0;
        i.write_bytes_per_s = 0;
        i.volume_read_bytes_per_s = 0;
        i.image_bytes = u64::MAX;
        i.unpacked_bytes = u64::MAX;
        i.starts_per_month = u64::MAX;
        let plan = i.plan();
        assert_eq!(plan.options.len(), 4);
        assert!(!plan.table().is_empty());
    }
}
