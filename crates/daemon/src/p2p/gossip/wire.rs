//! Gossip on the wire: the authenticated envelope around every datagram, and the codec
//! of foca's messages inside it. Everything here reads bytes from strangers, so every
//! read is checked against what is left, nothing is allocated on a length the datagram
//! claims, and nothing panics (`fuzz/fuzz_targets/p2p_gossip.rs`).
//!
//! A datagram is `magic (4) | unix ms (8) | nonce (8) | payload | tag (32)`, the tag an
//! HMAC-SHA256 of everything before it under a key derived from the cluster token.
//! The payload is foca's: a header, then optionally a `u16` count and that many member
//! updates.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use bytes::{Buf, BufMut};
use foca::{Header, Member, Message, State};
use hmac::{Hmac, Mac};
use sha2::{Digest as _, Sha256};

/// The first bytes of every gossip datagram (the format's version is in them).
pub const MAGIC: [u8; 4] = *b"FYG1";
/// Largest payload foca produces and accepts (under a 1,500-byte MTU with the
/// envelope, IP and UDP headers).
pub const MAX_PAYLOAD: usize = 1400;
const PREFIX_LEN: usize = 4 + 8 + 8;
const TAG_LEN: usize = 32;
/// Largest datagram accepted; a longer one is dropped before anything is looked at.
pub const MAX_DATAGRAM: usize = PREFIX_LEN + MAX_PAYLOAD + TAG_LEN;
/// Longest peer-server name (`host:port`) an identity may carry.
pub const MAX_NAME: usize = 255;
/// Fewest bytes one encoded member takes (a 1-byte name, an IPv4 address).
const MIN_MEMBER_LEN: usize = 1 + 1 + 1 + 4 + 2 + 8 + 2 + 1;

type HmacSha256 = Hmac<Sha256>;

/// The key gossip datagrams are authenticated with, derived from the cluster token
/// (never the token itself, so a leak of one does not hand over the other's use).
#[derive(Clone)]
pub struct GossipKey([u8; 32]);

impl std::fmt::Debug for GossipKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GossipKey(..)")
    }
}

impl GossipKey {
    /// The key for the cluster secret `secret` (the token's bytes).
    pub fn from_secret(secret: &[u8]) -> GossipKey {
        let mut h = Sha256::new();
        h.update(b"ferry p2p gossip v1\0");
        h.update(secret);
        GossipKey(h.finalize().into())
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes a key of any length; 32 bytes is never refused.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

/// Why a datagram or its payload was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Longer than [`MAX_DATAGRAM`].
    #[error("datagram too large")]
    Oversized,
    /// Too short, wrong magic, or a tag that is not ours.
    #[error("datagram not authenticated")]
    Unauthenticated,
    /// The payload does not decode.
    #[error("malformed payload: {0}")]
    Malformed(&'static str),
}

/// An authenticated datagram, opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened<'a> {
    /// When the sender sealed it (milliseconds since the Unix epoch, its clock).
    pub unix_ms: u64,
    /// The tag: unique per datagram (the nonce sees to it), the replay key.
    pub tag: [u8; TAG_LEN],
    /// foca's bytes.
    pub payload: &'a [u8],
}

/// `payload` in an envelope: stamped `unix_ms`, made unique by `nonce`, tagged.
pub fn seal(key: &GossipKey, unix_ms: u64, nonce: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_LEN + payload.len() + TAG_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&unix_ms.to_be_bytes());
    out.extend_from_slice(&nonce.to_be_bytes());
    out.extend_from_slice(payload);
    let mut mac = key.mac();
    mac.update(&out);
    out.extend_from_slice(&mac.finalize().into_bytes());
    out
}

/// The payload of `datagram`, when it is at most [`MAX_DATAGRAM`] bytes and its tag is
/// `key`'s (checked in constant time). Freshness and replays are the caller's.
pub fn open<'a>(key: &GossipKey, datagram: &'a [u8]) -> Result<Opened<'a>, WireError> {
    if datagram.len() > MAX_DATAGRAM {
        return Err(WireError::Oversized);
    }
    if datagram.len() < PREFIX_LEN + TAG_LEN || datagram[..4] != MAGIC {
        return Err(WireError::Unauthenticated);
    }
    let (body, tag) = datagram.split_at(datagram.len() - TAG_LEN);
    let mut mac = key.mac();
    mac.update(body);
    mac.verify_slice(tag)
        .map_err(|_| WireError::Unauthenticated)?;
    let mut ms = [0u8; 8];
    ms.copy_from_slice(&body[4..12]);
    let mut t = [0u8; TAG_LEN];
    t.copy_from_slice(tag);
    Ok(Opened {
        unix_ms: u64::from_be_bytes(ms),
        tag: t,
        payload: &body[PREFIX_LEN..],
    })
}

/// A member's identity in the gossip: the peer-server name the scheduling uses, the
/// UDP address its gossip listens at (what foca tells members apart by), and a
/// generation that grows with each start, so a restarted daemon wins over its old
/// self.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GossipId {
    /// `host:port` of its peer server, as the other membership sources spell it.
    pub peer: String,
    /// Where its gossip is reached.
    pub gossip: SocketAddr,
    /// Grows with each start (and each rejoin after being declared down).
    pub generation: u64,
}

impl foca::Identity for GossipId {
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(GossipId {
            generation: self.generation.wrapping_add(1),
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.gossip
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        (self.generation, &self.peer) > (adversary.generation, &adversary.peer)
    }
}

/// Whether `name` may be a member's peer-server name: `host:port`, visible ASCII, no
/// character that would turn it into more than a host in a URL.
pub fn valid_peer_name(name: &str) -> bool {
    let Some((host, port)) = name.rsplit_once(':') else {
        return false;
    };
    !host.is_empty()
        && name.len() <= MAX_NAME
        && port.parse::<u16>().is_ok()
        && name.bytes().all(|b| b.is_ascii_graphic())
        && !name.contains(['/', '@', '?', '#', '\\', '%'])
}

/// foca's codec for [`GossipId`]: a compact, bounded binary form.
#[derive(Debug, Clone, Copy, Default)]
pub struct WireCodec;

fn need(buf: &impl Buf, n: usize) -> Result<(), WireError> {
    if buf.remaining() < n {
        Err(WireError::Malformed("truncated"))
    } else {
        Ok(())
    }
}

fn get_u8(buf: &mut impl Buf) -> Result<u8, WireError> {
    need(buf, 1)?;
    Ok(buf.get_u8())
}

fn get_u16(buf: &mut impl Buf) -> Result<u16, WireError> {
    need(buf, 2)?;
    Ok(buf.get_u16())
}

fn get_u64(buf: &mut impl Buf) -> Result<u64, WireError> {
    need(buf, 8)?;
    Ok(buf.get_u64())
}

fn put_id(id: &GossipId, out: &mut Vec<u8>) -> Result<(), WireError> {
    let name = id.peer.as_bytes();
    let len = u8::try_from(name.len()).map_err(|_| WireError::Malformed("name too long"))?;
    out.put_u8(len);
    out.put_slice(name);
    match id.gossip.ip() {
        IpAddr::V4(ip) => {
            out.put_u8(4);
            out.put_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.put_u8(6);
            out.put_slice(&ip.octets());
        }
    }
    out.put_u16(id.gossip.port());
    out.put_u64(id.generation);
    Ok(())
}

fn get_id(buf: &mut impl Buf) -> Result<GossipId, WireError> {
    let len = usize::from(get_u8(buf)?);
    need(buf, len)?;
    let mut name = vec![0u8; len];
    buf.copy_to_slice(&mut name);
    let peer = String::from_utf8(name).map_err(|_| WireError::Malformed("name"))?;
    if !valid_peer_name(&peer) {
        return Err(WireError::Malformed("name"));
    }
    let ip = match get_u8(buf)? {
        4 => {
            need(buf, 4)?;
            let mut o = [0u8; 4];
            buf.copy_to_slice(&mut o);
            IpAddr::V4(Ipv4Addr::from(o))
        }
        6 => {
            need(buf, 16)?;
            let mut o = [0u8; 16];
            buf.copy_to_slice(&mut o);
            IpAddr::V6(Ipv6Addr::from(o))
        }
        _ => return Err(WireError::Malformed("address family")),
    };
    let port = get_u16(buf)?;
    let generation = get_u64(buf)?;
    Ok(GossipId {
        peer,
        gossip: SocketAddr::new(ip, port),
        generation,
    })
}

fn put_message(m: &Message<GossipId>, out: &mut Vec<u8>) -> Result<(), WireError> {
    let (tag, id, n) = match m {
        Message::Ping(n) => (0, None, Some(*n)),
        Message::Ack(n) => (1, None, Some(*n)),
        Message::PingReq {
            target,
            probe_number,
        } => (2, Some(target), Some(*probe_number)),
        Message::IndirectPing {
            origin,
            probe_number,
        } => (3, Some(origin), Some(*probe_number)),
        Message::IndirectAck {
            target,
            probe_number,
        } => (4, Some(target), Some(*probe_number)),
        Message::ForwardedAck {
            origin,
            probe_number,
        } => (5, Some(origin), Some(*probe_number)),
        Message::Announce => (6, None, None),
        Message::Feed => (7, None, None),
        Message::Gossip => (8, None, None),
        Message::Broadcast => (9, None, None),
        Message::TurnUndead => (10, None, None),
    };
    out.put_u8(tag);
    if let Some(id) = id {
        put_id(id, out)?;
    }
    if let Some(n) = n {
        out.put_u8(n);
    }
    Ok(())
}

fn get_message(buf: &mut impl Buf) -> Result<Message<GossipId>, WireError> {
    Ok(match get_u8(buf)? {
        0 => Message::Ping(get_u8(buf)?),
        1 => Message::Ack(get_u8(buf)?),
        2 => {
            let target = get_id(buf)?;
            Message::PingReq {
                target,
                probe_number: get_u8(buf)?,
            }
        }
        3 => {
            let origin = get_id(buf)?;
            Message::IndirectPing {
                origin,
                probe_number: get_u8(buf)?,
            }
        }
        4 => {
            let target = get_id(buf)?;
            Message::IndirectAck {
                target,
                probe_number: get_u8(buf)?,
            }
        }
        5 => {
            let origin = get_id(buf)?;
            Message::ForwardedAck {
                origin,
                probe_number: get_u8(buf)?,
            }
        }
        6 => Message::Announce,
        7 => Message::Feed,
        8 => Message::Gossip,
        9 => Message::Broadcast,
        10 => Message::TurnUndead,
        _ => return Err(WireError::Malformed("message kind")),
    })
}

fn state_byte(s: State) -> u8 {
    match s {
        State::Alive => 0,
        State::Suspect => 1,
        State::Down => 2,
    }
}

impl foca::Codec<GossipId> for WireCodec {
    type Error = WireError;

    fn encode_header(
        &mut self,
        header: &Header<GossipId>,
        mut buf: impl BufMut,
    ) -> Result<(), WireError> {
        let mut out = Vec::with_capacity(2 * (MAX_NAME + 30));
        put_id(&header.src, &mut out)?;
        out.put_u16(header.src_incarnation);
        put_id(&header.dst, &mut out)?;
        put_message(&header.message, &mut out)?;
        if buf.remaining_mut() < out.len() {
            return Err(WireError::Malformed("no room"));
        }
        buf.put_slice(&out);
        Ok(())
    }

    fn decode_header(&mut self, mut buf: impl Buf) -> Result<Header<GossipId>, WireError> {
        let src = get_id(&mut buf)?;
        let src_incarnation = get_u16(&mut buf)?;
        let dst = get_id(&mut buf)?;
        let message = get_message(&mut buf)?;
        Ok(Header {
            src,
            src_incarnation,
            dst,
            message,
        })
    }

    fn encode_member(
        &mut self,
        member: &Member<GossipId>,
        mut buf: impl BufMut,
    ) -> Result<(), WireError> {
        let mut out = Vec::with_capacity(MAX_NAME + 32);
        put_id(member.id(), &mut out)?;
        out.put_u16(member.incarnation());
        out.put_u8(state_byte(member.state()));
        // foca requires a full buffer to be left as it was.
        if buf.remaining_mut() < out.len() {
            return Err(WireError::Malformed("no room"));
        }
        buf.put_slice(&out);
        Ok(())
    }

    fn decode_member(&mut self, mut buf: impl Buf) -> Result<Member<GossipId>, WireError> {
        let id = get_id(&mut buf)?;
        let incarnation = get_u16(&mut buf)?;
        let state = match get_u8(&mut buf)? {
            0 => State::Alive,
            1 => State::Suspect,
            2 => State::Down,
            _ => return Err(WireError::Malformed("member state")),
        };
        Ok(Member::new(id, incarnation, state))
    }
}

/// A payload, decoded (what [`decode_payload`] checks before foca sees it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    pub header: Header<GossipId>,
    pub updates: Vec<Member<GossipId>>,
}

impl Payload {
    /// Every identity the payload names (sender, receiver, message, updates).
    pub fn identities(&self) -> impl Iterator<Item = &GossipId> {
        let in_message = match &self.header.message {
            Message::PingReq { target: id, .. }
            | Message::IndirectPing { origin: id, .. }
            | Message::IndirectAck { target: id, .. }
            | Message::ForwardedAck { origin: id, .. } => Some(id),
            _ => None,
        };
        [&self.header.src, &self.header.dst]
            .into_iter()
            .chain(in_message)
            .chain(self.updates.iter().map(|m| m.id()))
    }
}

/// foca's `payload`, decoded the way foca will decode it, and refused when it is
/// larger than [`MAX_PAYLOAD`], carries bytes after its updates, or a custom
/// broadcast (ferry sends none).
pub fn decode_payload(payload: &[u8]) -> Result<Payload, WireError> {
    use foca::Codec as _;
    if payload.len() > MAX_PAYLOAD {
        return Err(WireError::Oversized);
    }
    let mut buf = payload;
    let header = WireCodec.decode_header(&mut buf)?;
    let mut updates = Vec::new();
    if buf.remaining() > 0 {
        if header.message == Message::Announce || header.message == Message::Broadcast {
            return Err(WireError::Malformed("unexpected updates"));
        }
        let n = usize::from(get_u16(&mut buf)?);
        // Never trust the count for the allocation: each member takes some bytes.
        updates.reserve(n.min(buf.remaining() / MIN_MEMBER_LEN));
        for _ in 0..n {
            updates.push(WireCodec.decode_member(&mut buf)?);
        }
        if buf.remaining() > 0 {
            return Err(WireError::Malformed("trailing bytes"));
        }
    }
    Ok(Payload { header, updates })
}

/// `p` encoded as foca would send it (tests and the fuzz target's round trip).
pub fn encode_payload(p: &Payload) -> Result<Vec<u8>, WireError> {
    use foca::Codec as _;
    let mut out = Vec::new();
    WireCodec.encode_header(&p.header, &mut out)?;
    if !p.updates.is_empty() {
        let n = u16::try_from(p.updates.len()).map_err(|_| WireError::Malformed("count"))?;
        out.put_u16(n);
        for m in &p.updates {
            WireCodec.encode_member(m, &mut out)?;
        }
    }
    Ok(out)
}
