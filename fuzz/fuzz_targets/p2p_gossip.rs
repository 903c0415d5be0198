//! Fuzzes what a gossip datagram carries into the daemon: the envelope (size bound,
//! HMAC tag), the decoding of foca's payload (identities, messages, member updates),
//! and the whole node taking it (the member cap, foca itself). Nothing may panic; a
//! datagram under another key is never taken; a payload that decodes encodes back to
//! the same bytes; the node never knows more members than its bound.
#![no_main]

use std::sync::Arc;
use std::time::Duration;

use ferry_daemon::p2p::P2pStats;
use ferry_daemon::p2p::gossip::{
    Clock, Dropped, GossipConfig, GossipId, GossipKey, GossipNode, ManualClock, wire,
};
use libfuzzer_sys::fuzz_target;

const EPOCH_MS: u64 = 1_800_000_000_000;

fuzz_target!(|data: &[u8]| {
    let key = GossipKey::from_secret(b"fuzz-cluster-token-0123456789");
    // As received: almost never authenticated, must not panic either way.
    let _ = wire::open(&key, data);
    // As a payload that passed the tag (a cluster member's bytes).
    if let Ok(p) = wire::decode_payload(data) {
        let again = wire::encode_payload(&p).expect("a decoded payload encodes");
        assert_eq!(wire::decode_payload(&again).as_ref(), Ok(&p));
        for id in p.identities() {
            assert!(wire::valid_peer_name(&id.peer));
        }
    }
    let clock = Arc::new(ManualClock::new(EPOCH_MS));
    let max_members = 4;
    let mut node = GossipNode::new(
        GossipConfig {
            me: GossipId {
                peer: "10.0.0.1:7050".into(),
                gossip: "10.0.0.1:7946".parse().expect("an address"),
                generation: 1,
            },
            probe_period: Duration::from_secs(1),
            probe_rtt: Duration::from_millis(300),
            suspect_after: Duration::from_secs(3),
            gossip_interval: Duration::from_millis(200),
            max_members,
            max_skew: Duration::from_secs(30),
        },
        key.clone(),
        clock.clone(),
        1,
        Arc::new(P2pStats::default()),
    );
    // Under another key: never taken.
    let other = GossipKey::from_secret(b"another-cluster-token-0123");
    let forged = wire::seal(&other, EPOCH_MS, 1, data);
    assert!(matches!(
        node.handle_datagram(&forged),
        Err(Dropped::Unauthenticated | Dropped::Oversized)
    ));
    // Under ours, in pieces (several datagrams from one input), with time passing.
    for (i, part) in data.split(|b| *b == 0xA5).enumerate() {
        let sealed = wire::seal(&key, clock.unix_ms(), i as u64, part);
        let _ = node.handle_datagram(&sealed);
        clock.advance(Duration::from_millis(250));
        node.handle_due_timers();
        let _ = node.take_outbox();
    }
    assert!(node.members().len() <= max_members);
});
