//! Random access into an unmodified gzip blob (the zlib `zran.c` idea).
//!
//! [`GzipIndexer`] decompresses a gzip layer blob once, as a [`Read`] adaptor, and
//! records on the way a list of [`Checkpoint`]s from which inflation can restart, plus
//! one SHA-256 per span of compressed bytes and the SHA-256 of the whole blob.
//! [`extract`] later decompresses any uncompressed byte range starting from the nearest
//! checkpoint before it, given only the compressed bytes of the spans it needs.
//!
//! # Stream format accepted
//!
//! One or more gzip members (RFC 1952) back to back, as `gzip`, pigz and eStargz writers
//! produce. Each member's header is parsed here ([`parse_member_header`], bounded), its
//! deflate data is inflated as raw deflate, and its trailer's CRC-32 and ISIZE are
//! verified. After the last member the blob may end with zero bytes (tape-style padding,
//! which `gzip -d` also accepts); anything else after a member is an error.
//!
//! # Checkpoint placement
//!
//! Candidates are every deflate block boundary inside a member (found with `Z_BLOCK`)
//! and every member start. The rule is deterministic and independent of how the caller
//! reads:
//!
//! * the first checkpoint is at the first member's header (uncompressed offset 0);
//! * afterwards a candidate becomes a checkpoint when its uncompressed offset is at least
//!   `span` bytes past the previous checkpoint's;
//! * a checkpoint is never left at the very end of the uncompressed stream
//!   (`out_offset == uncompressed_size`), except the first one of an empty stream.
//!
//! Member-start checkpoints point at the member header and carry no window; block
//! boundary checkpoints carry the up to 32 KiB of uncompressed history of the member
//! before them, compressed as raw deflate (libdeflate level 6, deterministic).
//!
//! # Spans
//!
//! Span `i` is checkpoint `i` up to checkpoint `i + 1`; its compressed bytes are
//! `[cp_i.start_byte(), cp_{i+1}.in_offset)` and, for the last span, up to the end of the
//! blob (trailing padding included), so the span digests cover every byte of the blob.

use std::ffi::{CStr, c_int};
use std::fmt;
use std::io::{self, Read};

use libz_rs_sys as zsys;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::ferryidx::Checkpoint;

/// Default distance, in uncompressed bytes, between checkpoints.
///
/// Chosen by `bench/read.sh` on the 1.2 GB bench image (docs/benchmarks.md): with the
/// windows out of the index blob (version 2) the span no longer sizes what a mount
/// decodes (0.22% of the layers at 256 KiB), only what a cold read fetches: a span plus
/// its window, 125 KB on average at 256 KiB against 404 KB at 1 MiB, at under a third of
/// the latency. The price is a windows blob of about 11% of the layers, fetched a window
/// per miss (reads moving on keep the later ones; all of it only by background fill).
pub const DEFAULT_SPAN: u64 = 256 << 10;

/// Size of the deflate history window.
pub const WINDOW_SIZE: usize = 32 * 1024;

/// Longest FNAME or FCOMMENT field accepted in a member header, terminating zero included.
pub const MAX_HEADER_STRING: usize = 64 * 1024;

/// Longest possible accepted member header.
const MAX_HEADER_LEN: usize = 10 + 2 + u16::MAX as usize + 2 * MAX_HEADER_STRING + 2;

/// Input buffer of the indexer; holds any accepted header whole.
const IN_BUF_SIZE: usize = 256 * 1024;
const _: () = assert!(MAX_HEADER_LEN + (KEEP_BEHIND as usize) < IN_BUF_SIZE);

/// Bytes before the inflate read position that are kept in the input buffer: inflate may
/// hold up to 63 bits it has read but not used, and a checkpoint's first byte may be the
/// one before those.
const KEEP_BEHIND: u64 = 8;

/// Reads smaller than this go through an internal buffer so that inflate can use its fast
/// path on large chunks.
const SMALL_READ: usize = 32 * 1024;
const OUT_BUF_SIZE: usize = 256 * 1024;

/// Below this distance to the next possible checkpoint, inflate stops at every block
/// boundary (`Z_BLOCK`); before it, plain `Z_NO_FLUSH` with a bounded output is used.
const BLOCK_MODE_DISTANCE: u64 = 64 * 1024;

// FTEXT (1) carries no structure and is ignored.
const FHCRC: u8 = 2;
const FEXTRA: u8 = 4;
const FNAME: u8 = 8;
const FCOMMENT: u8 = 16;
const FRESERVED: u8 = 0xe0;

fn gzip_err(msg: impl Into<String>) -> Error {
    Error::Gzip(msg.into())
}

// ---------------------------------------------------------------------------------------
// Safe wrapper over the zlib-rs C API.
// ---------------------------------------------------------------------------------------

/// Outcome of one `inflate` call.
#[derive(Debug, Clone, Copy)]
struct Step {
    code: c_int,
    consumed: usize,
    produced: usize,
    /// `z_stream.data_type`: low 6 bits = bits read but unused, 64 = in last block,
    /// 128 = at a block boundary.
    data_type: c_int,
    msg: Option<&'static str>,
}

impl Step {
    /// Bits inflate has taken from the input but not used yet.
    fn unused_bits(&self) -> u64 {
        (self.data_type & 63) as u64
    }

    /// Stopped right after a block that is not the stream's last one.
    fn at_block_boundary(&self) -> bool {
        self.data_type & 128 != 0 && self.data_type & 64 == 0
    }
}

/// A raw-deflate inflate stream. The `z_stream` is boxed so it never moves after
/// `inflateInit2_` (zlib keeps a pointer back to it); all pointers into caller buffers are
/// set right before and cleared right after each call.
struct Inflater {
    strm: Box<zsys::z_stream>,
}

// SAFETY: the stream and its state are exclusively owned by this value; no pointer into
// caller memory survives a method call, so moving it to another thread is sound.
unsafe impl Send for Inflater {}

impl Inflater {
    fn new() -> Result<Self> {
        let mut strm = Box::new(zsys::z_stream::default());
        // SAFETY: `strm` is a valid, default-initialised (allocator set) z_stream that
        // outlives the call; the version string is zlib-rs's own static C string.
        let ret = unsafe {
            zsys::inflateInit2_(
                &mut *strm,
                -15,
                zsys::zlibVersion(),
                size_of::<zsys::z_stream>() as c_int,
            )
        };
        if ret != zsys::Z_OK {
            return Err(gzip_err(format!(
                "cannot initialise inflate (zlib code {ret})"
            )));
        }
        Ok(Inflater { strm })
    }

    /// Starts a new raw deflate stream (next member), dropping the window.
    fn reset(&mut self) -> Result<()> {
        // SAFETY: the stream was initialised in `new`.
        let ret = unsafe { zsys::inflateReset(&mut *self.strm) };
        if ret != zsys::Z_OK {
            return Err(gzip_err(format!("inflateReset failed (zlib code {ret})")));
        }
        Ok(())
    }

    /// Inserts `bits` (0..=7) low bits of `value` before the next input byte.
    fn prime(&mut self, bits: u8, value: u8) -> Result<()> {
        if bits == 0 {
            return Ok(());
        }
        // SAFETY: the stream was initialised in `new`.
        let ret =
            unsafe { zsys::inflatePrime(&mut *self.strm, c_int::from(bits), c_int::from(value)) };
        if ret != zsys::Z_OK {
            return Err(gzip_err(format!("inflatePrime failed (zlib code {ret})")));
        }
        Ok(())
    }

    fn set_dictionary(&mut self, dict: &[u8]) -> Result<()> {
        if dict.is_empty() {
            return Ok(());
        }
        let len = u32::try_from(dict.len()).map_err(|_| gzip_err("dictionary too large"))?;
        // SAFETY: `dict` is valid for `len` bytes during the call; zlib copies it.
        let ret = unsafe { zsys::inflateSetDictionary(&mut *self.strm, dict.as_ptr(), len) };
        if ret != zsys::Z_OK {
            return Err(gzip_err(format!(
                "inflateSetDictionary failed (zlib code {ret})"
            )));
        }
        Ok(())
    }

    /// Copies the current history window (oldest byte first) into `buf`; returns its length.
    fn window(&self, buf: &mut [u8; WINDOW_SIZE]) -> Result<usize> {
        let mut len: zsys::uInt = 0;
        // SAFETY: the stream was initialised in `new`; `buf` has room for the largest
        // possible window (32 KiB for windowBits 15); `len` is a valid out pointer.
        let ret = unsafe { zsys::inflateGetDictionary(&*self.strm, buf.as_mut_ptr(), &mut len) };
        if ret != zsys::Z_OK || len as usize > WINDOW_SIZE {
            return Err(gzip_err(format!(
                "inflateGetDictionary failed (zlib code {ret})"
            )));
        }
        Ok(len as usize)
    }

    fn inflate(&mut self, input: &[u8], output: &mut [u8], flush: c_int) -> Step {
        let avail_in = u32::try_from(input.len()).unwrap_or(u32::MAX);
        let avail_out = u32::try_from(output.len()).unwrap_or(u32::MAX);
        let s = &mut *self.strm;
        s.next_in = input.as_ptr();
        s.avail_in = avail_in;
        s.next_out = output.as_mut_ptr();
        s.avail_out = avail_out;
        // SAFETY: the stream was initialised in `new`; next_in/avail_in and
        // next_out/avail_out describe live slices borrowed for the duration of the call.
        let code = unsafe { zsys::inflate(s, flush) };
        let consumed = (avail_in - s.avail_in) as usize;
        let produced = (avail_out - s.avail_out) as usize;
        let msg = if s.msg.is_null() {
            None
        } else {
            // SAFETY: zlib-rs only ever stores pointers to static NUL-terminated strings
            // in `msg`.
            unsafe { CStr::from_ptr(s.msg) }.to_str().ok()
        };
        s.next_in = std::ptr::null();
        s.avail_in = 0;
        s.next_out = std::ptr::null_mut();
        s.avail_out = 0;
        Step {
            code,
            consumed,
            produced,
            data_type: s.data_type,
            msg,
        }
    }
}

impl Drop for Inflater {
    fn drop(&mut self) {
        // SAFETY: the stream was initialised in `new` and is ended exactly once.
        unsafe {
            zsys::inflateEnd(&mut *self.strm);
        }
    }
}

fn inflate_error(step: &Step, at: u64) -> Error {
    let what = match step.code {
        zsys::Z_DATA_ERROR => "corrupt deflate data",
        zsys::Z_MEM_ERROR => "out of memory",
        zsys::Z_NEED_DICT => "unexpected dictionary request",
        _ => "inflate failed",
    };
    match step.msg {
        Some(m) => gzip_err(format!("{what} near compressed offset {at}: {m}")),
        None => gzip_err(format!(
            "{what} near compressed offset {at} (zlib code {})",
            step.code
        )),
    }
}

// ---------------------------------------------------------------------------------------
// Member header
// ---------------------------------------------------------------------------------------

/// Result of [`parse_member_header`] on a prefix of a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderParse {
    /// A whole, valid header of this many bytes starts the buffer.
    Complete(usize),
    /// The bytes so far are a valid beginning of a header; more are needed.
    Incomplete,
}

/// Parses one gzip member header at the start of `buf`.
///
/// Checks the magic bytes, method 8 (deflate), that no reserved flag is set, skips
/// FEXTRA (length-prefixed, so at most 64 KiB), FNAME and FCOMMENT (zero-terminated, at
/// most [`MAX_HEADER_STRING`] bytes each), and verifies FHCRC when present. Returns
/// [`HeaderParse::Incomplete`] when `buf` ends before the header does, an error as soon
/// as the bytes seen cannot start a valid header.
pub fn parse_member_header(buf: &[u8]) -> Result<HeaderParse> {
    use HeaderParse::Incomplete;
    for (i, want) in [0x1fu8, 0x8b].into_iter().enumerate() {
        match buf.get(i) {
            None => return Ok(Incomplete),
            Some(&b) if b != want => {
                return Err(gzip_err(format!(
                    "not a gzip member: bad magic byte {b:#04x}"
                )));
            }
            Some(_) => {}
        }
    }
    match buf.get(2) {
        None => return Ok(Incomplete),
        Some(8) => {}
        Some(m) => return Err(gzip_err(format!("unknown compression method {m}"))),
    }
    let Some(&flags) = buf.get(3) else {
        return Ok(Incomplete);
    };
    if flags & FRESERVED != 0 {
        return Err(gzip_err(format!(
            "reserved header flags set ({flags:#04x})"
        )));
    }
    let mut pos = 10usize;
    if buf.len() < pos {
        return Ok(Incomplete);
    }
    if flags & FEXTRA != 0 {
        let Some(len) = buf.get(pos..pos + 2) else {
            return Ok(Incomplete);
        };
        let xlen = u16::from_le_bytes([len[0], len[1]]) as usize;
        pos += 2 + xlen;
        if buf.len() < pos {
            return Ok(Incomplete);
        }
    }
    for (flag, name) in [(FNAME, "file name"), (FCOMMENT, "comment")] {
        if flags & flag == 0 {
            continue;
        }
        let rest = &buf[pos..];
        let look = &rest[..rest.len().min(MAX_HEADER_STRING)];
        match look.iter().position(|&b| b == 0) {
            Some(z) => pos += z + 1,
            None if rest.len() >= MAX_HEADER_STRING => {
                return Err(gzip_err(format!(
                    "header {name} longer than {MAX_HEADER_STRING} bytes"
                )));
            }
            None => return Ok(Incomplete),
        }
    }
    if flags & FHCRC != 0 {
        let Some(c) = buf.get(pos..pos + 2) else {
            return Ok(Incomplete);
        };
        let want = u16::from_le_bytes([c[0], c[1]]);
        let got = crc32fast::hash(&buf[..pos]) as u16;
        if want != got {
            return Err(gzip_err(format!(
                "header CRC mismatch: stored {want:#06x}, computed {got:#06x}"
            )));
        }
        pos += 2;
    }
    Ok(HeaderParse::Complete(pos))
}

// ---------------------------------------------------------------------------------------
// Indexer
// ---------------------------------------------------------------------------------------

/// The result of indexing a gzip blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GzipIndex {
    /// Checkpoints in increasing `out_offset` order; the first is at the first member's
    /// header, offset 0.
    pub checkpoints: Vec<Checkpoint>,
    /// SHA-256 of each span's compressed bytes, one per checkpoint.
    pub span_digests: Vec<[u8; 32]>,
    /// Size of the blob in bytes (trailing padding included).
    pub compressed_size: u64,
    /// Size of the uncompressed stream in bytes.
    pub uncompressed_size: u64,
    /// SHA-256 of the whole compressed blob.
    pub blob_sha256: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Expecting a member header (or, after the first member, the end or padding).
    Header,
    /// Inside a member's deflate data.
    Inflate,
    /// Expecting a member's 8-byte trailer.
    Trailer,
    /// In the zero padding after the last member.
    Padding,
    /// At the end of the blob, everything verified.
    Done,
    /// A format error happened; it is returned again on every call.
    Failed(String),
}

/// A checkpoint placed but not yet known not to be at the end of the stream: it is
/// confirmed as soon as any output follows it, dropped if the stream ends first.
struct Pending {
    cp: Checkpoint,
    /// Digest of the span that the checkpoint ends.
    prev_digest: [u8; 32],
    /// Hasher of the span the checkpoint starts.
    hasher: Sha256,
}

/// Read adaptor: reads a gzip blob from `inner`, yields the uncompressed bytes through
/// [`Read`], and records checkpoints and span digests as it goes.
///
/// Reads of at least 32 KiB are inflated straight into the caller's buffer; smaller ones
/// go through an internal buffer. Gzip format errors are returned as
/// `io::ErrorKind::InvalidData` errors wrapping [`Error::Gzip`] (so the text says what is
/// wrong and where), and are sticky; errors of `inner` are passed through as they are.
pub struct GzipIndexer<R: Read> {
    inner: R,
    span: u64,
    inflater: Result<Inflater, String>,
    /// Created at the first windowed checkpoint (its state is a few hundred KiB).
    compressor: Option<libdeflater::Compressor>,
    window: Box<[u8; WINDOW_SIZE]>,

    /// Input buffer: `inbuf[i]` is blob byte `in_base + i`; `[in_start, in_end)` is not
    /// consumed yet.
    inbuf: Box<[u8]>,
    in_base: u64,
    in_start: usize,
    in_end: usize,
    eof: bool,
    blob_hasher: Sha256,

    /// Internal output buffer for small reads: `[out_pos, out_end)` not delivered yet.
    outbuf: Vec<u8>,
    out_pos: usize,
    out_end: usize,

    state: State,
    members: u64,
    total_out: u64,
    member_out_start: u64,
    member_crc: crc32fast::Hasher,

    checkpoints: Vec<Checkpoint>,
    span_digests: Vec<[u8; 32]>,
    span_hasher: Sha256,
    /// Blob offset up to which the span hasher(s) have been fed.
    hashed_to: u64,
    pending: Option<Pending>,
}

impl<R: Read> fmt::Debug for GzipIndexer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GzipIndexer")
            .field("span", &self.span)
            .field("state", &self.state)
            .field("compressed_read", &(self.in_base + self.in_end as u64))
            .field("members", &self.members)
            .field("total_out", &self.total_out)
            .field("checkpoints", &self.checkpoints.len())
            .finish_non_exhaustive()
    }
}

impl<R: Read> GzipIndexer<R> {
    /// Wraps `inner`, placing checkpoints about every `span` uncompressed bytes
    /// (`span` 0 is treated as 1).
    pub fn new(inner: R, span: u64) -> Self {
        GzipIndexer {
            inner,
            span: span.max(1),
            inflater: Inflater::new().map_err(|e| e.to_string()),
            compressor: None,
            window: Box::new([0u8; WINDOW_SIZE]),
            inbuf: vec![0u8; IN_BUF_SIZE].into_boxed_slice(),
            in_base: 0,
            in_start: 0,
            in_end: 0,
            eof: false,
            blob_hasher: Sha256::new(),
            outbuf: Vec::new(),
            out_pos: 0,
            out_end: 0,
            state: State::Header,
            members: 0,
            total_out: 0,
            member_out_start: 0,
            member_crc: crc32fast::Hasher::new(),
            checkpoints: Vec::new(),
            span_digests: Vec::new(),
            span_hasher: Sha256::new(),
            hashed_to: 0,
            pending: None,
        }
    }

    /// Uncompressed bytes delivered to the caller so far.
    pub fn uncompressed_offset(&self) -> u64 {
        self.total_out - (self.out_end - self.out_pos) as u64
    }

    /// Drains whatever the caller did not read, verifies the end of the stream, and
    /// returns the result.
    pub fn finish(mut self) -> Result<GzipIndex> {
        self.out_pos = 0;
        self.out_end = 0;
        let mut scratch = std::mem::take(&mut self.outbuf);
        scratch.resize(OUT_BUF_SIZE, 0);
        while self.produce(&mut scratch)? > 0 {}
        // The stream is done: a pending checkpoint sits at the very end; drop it.
        self.pending = None;
        let end = self.in_base + self.in_end as u64;
        self.hash_to(end);
        let last = std::mem::take(&mut self.span_hasher).finalize();
        self.span_digests.push(last.into());
        Ok(GzipIndex {
            checkpoints: self.checkpoints,
            span_digests: self.span_digests,
            compressed_size: end,
            uncompressed_size: self.total_out,
            blob_sha256: self.blob_hasher.finalize().into(),
        })
    }

    /// Produces uncompressed bytes into `out` (non-empty); 0 only at the end of the blob.
    fn produce(&mut self, out: &mut [u8]) -> Result<usize> {
        let r = self.produce_inner(out);
        if let Err(Error::Gzip(msg)) = &r {
            self.state = State::Failed(msg.clone());
        }
        r
    }

    fn produce_inner(&mut self, out: &mut [u8]) -> Result<usize> {
        loop {
            match &self.state {
                State::Done => return Ok(0),
                State::Failed(msg) => return Err(Error::Gzip(msg.clone())),
                State::Header => self.step_header()?,
                State::Trailer => self.step_trailer()?,
                State::Padding => self.step_padding()?,
                State::Inflate => {
                    let n = self.step_inflate(out)?;
                    if n > 0 {
                        return Ok(n);
                    }
                }
            }
        }
    }

    fn pos(&self) -> u64 {
        self.in_base + self.in_start as u64
    }

    fn avail(&self) -> &[u8] {
        &self.inbuf[self.in_start..self.in_end]
    }

    /// Reads more input (after making room); sets `eof` when `inner` is exhausted.
    fn fill(&mut self) -> Result<()> {
        if self.eof {
            return Ok(());
        }
        if self.inbuf.len() - self.in_end < IN_BUF_SIZE / 4 {
            self.compact();
        }
        if self.in_end == self.inbuf.len() {
            return Err(gzip_err("internal: input buffer full"));
        }
        loop {
            match self.inner.read(&mut self.inbuf[self.in_end..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    let n = n.min(self.inbuf.len() - self.in_end);
                    self.blob_hasher
                        .update(&self.inbuf[self.in_end..self.in_end + n]);
                    self.in_end += n;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Io(e)),
            }
        }
    }

    /// Drops consumed input except the last [`KEEP_BEHIND`] bytes, hashing what it drops.
    fn compact(&mut self) {
        let drop_to = self.pos().saturating_sub(KEEP_BEHIND).max(self.in_base);
        if drop_to > self.hashed_to {
            self.hash_to(drop_to);
        }
        let shift = (drop_to - self.in_base) as usize;
        if shift == 0 {
            return;
        }
        self.inbuf.copy_within(shift..self.in_end, 0);
        self.in_base = drop_to;
        self.in_start -= shift;
        self.in_end -= shift;
    }

    /// Feeds blob bytes `[hashed_to, upto)` (still in the input buffer) to the span
    /// hasher and, if a checkpoint is pending, to the next span's hasher too.
    fn hash_to(&mut self, upto: u64) {
        if upto <= self.hashed_to {
            return;
        }
        let from = (self.hashed_to - self.in_base) as usize;
        let to = (upto - self.in_base) as usize;
        let bytes = &self.inbuf[from..to];
        self.span_hasher.update(bytes);
        if let Some(p) = &mut self.pending {
            p.hasher.update(bytes);
        }
        self.hashed_to = upto;
    }

    fn last_checkpoint_out(&self) -> Option<u64> {
        match &self.pending {
            Some(p) => Some(p.cp.out_offset),
            None => self.checkpoints.last().map(|c| c.out_offset),
        }
    }

    fn wants_checkpoint(&self) -> bool {
        match self.last_checkpoint_out() {
            None => true,
            Some(last) => self.total_out - last >= self.span,
        }
    }

    fn confirm_pending(&mut self) {
        if let Some(p) = self.pending.take() {
            self.span_digests.push(p.prev_digest);
            self.checkpoints.push(p.cp);
            self.span_hasher = p.hasher;
        }
    }

    /// Places `cp` (its `in_offset` must be at or before the read position).
    fn place(&mut self, cp: Checkpoint) {
        if self.checkpoints.is_empty() && self.pending.is_none() {
            // The first checkpoint is the blob's first byte; the span hasher starts there.
            debug_assert_eq!(cp.in_offset, 0);
            self.checkpoints.push(cp);
            return;
        }
        self.confirm_pending();
        self.hash_to(cp.in_offset);
        let prev_digest = self.span_hasher.clone().finalize().into();
        let mut hasher = Sha256::new();
        if cp.bits > 0 {
            // The byte shared with the previous span.
            let shared = (cp.in_offset - 1 - self.in_base) as usize;
            hasher.update(&self.inbuf[shared..=shared]);
        }
        self.pending = Some(Pending {
            cp,
            prev_digest,
            hasher,
        });
    }

    fn step_header(&mut self) -> Result<()> {
        if self.avail().is_empty() {
            if !self.eof {
                return self.fill();
            }
            if self.members == 0 {
                return Err(gzip_err("empty input: no gzip member"));
            }
            self.state = State::Done;
            return Ok(());
        }
        let at = self.pos();
        if self.members > 0 && self.avail()[0] == 0 {
            self.state = State::Padding;
            return Ok(());
        }
        let len = match parse_member_header(self.avail()) {
            Ok(HeaderParse::Complete(len)) => len,
            Ok(HeaderParse::Incomplete) => {
                if self.eof {
                    return Err(gzip_err(format!(
                        "truncated gzip member header at offset {at}"
                    )));
                }
                return self.fill();
            }
            Err(Error::Gzip(msg)) if self.members > 0 => {
                return Err(gzip_err(format!(
                    "trailing garbage after gzip member {} at offset {at}: {msg}",
                    self.members
                )));
            }
            Err(Error::Gzip(msg)) => {
                return Err(gzip_err(format!("member header at offset {at}: {msg}")));
            }
            Err(e) => return Err(e),
        };
        if self.wants_checkpoint() {
            self.place(Checkpoint {
                in_offset: at,
                bits: 0,
                out_offset: self.total_out,
                member_start: true,
                window_deflate: Vec::new(),
                window: None,
            });
        }
        self.inflater_mut()?.reset()?;
        self.in_start += len;
        self.members += 1;
        self.member_out_start = self.total_out;
        self.member_crc = crc32fast::Hasher::new();
        self.state = State::Inflate;
        Ok(())
    }

    fn inflater_mut(&mut self) -> Result<&mut Inflater> {
        self.inflater.as_mut().map_err(|e| gzip_err(e.clone()))
    }

    fn step_inflate(&mut self, out: &mut [u8]) -> Result<usize> {
        if self.in_start == self.in_end && !self.eof {
            self.fill()?;
        }
        // Only boundaries at least `span` past the last checkpoint matter: inflate without
        // stopping at block boundaries until close to that point.
        let (flush, cap) = match self.last_checkpoint_out() {
            Some(last) => {
                let dist = (last + self.span).saturating_sub(self.total_out);
                if dist > out.len() as u64 {
                    (zsys::Z_NO_FLUSH, out.len())
                } else if dist > BLOCK_MODE_DISTANCE {
                    (zsys::Z_NO_FLUSH, (dist - 1) as usize)
                } else {
                    (zsys::Z_BLOCK, out.len())
                }
            }
            None => (zsys::Z_BLOCK, out.len()),
        };
        let at = self.pos();
        let (start, end) = (self.in_start, self.in_end);
        let inflater = match self.inflater.as_mut() {
            Ok(i) => i,
            Err(e) => return Err(gzip_err(e.clone())),
        };
        let step = inflater.inflate(&self.inbuf[start..end], &mut out[..cap], flush);
        self.in_start += step.consumed;
        let produced = step.produced;
        if produced > 0 {
            self.member_crc.update(&out[..produced]);
            self.total_out += produced as u64;
            self.confirm_pending();
        }
        match step.code {
            zsys::Z_OK => {
                if step.at_block_boundary() && self.wants_checkpoint() {
                    self.block_checkpoint(step.unused_bits())?;
                }
            }
            zsys::Z_STREAM_END => {
                // Inflate may have read whole bytes past the end of the deflate data.
                let back = (step.unused_bits() / 8) as usize;
                self.in_start = self
                    .in_start
                    .checked_sub(back)
                    .ok_or_else(|| gzip_err("internal: inflate over-read"))?;
                self.state = State::Trailer;
            }
            zsys::Z_BUF_ERROR => {
                if self.in_start < self.in_end {
                    return Err(gzip_err(format!(
                        "internal: inflate made no progress at offset {at}"
                    )));
                }
                if self.eof {
                    return Err(gzip_err(format!(
                        "truncated deflate data in gzip member {} (blob ends at {})",
                        self.members,
                        self.pos()
                    )));
                }
            }
            _ => return Err(inflate_error(&step, at)),
        }
        Ok(produced)
    }

    /// Places a checkpoint at the block boundary inflate just stopped at.
    fn block_checkpoint(&mut self, unused_bits: u64) -> Result<()> {
        let bits = (unused_bits % 8) as u8;
        let in_offset = self
            .pos()
            .checked_sub(unused_bits / 8)
            .filter(|&o| o >= self.in_base.max(self.hashed_to) + u64::from(bits > 0))
            .ok_or_else(|| gzip_err("internal: checkpoint before the input buffer"))?;
        let inflater = self.inflater.as_ref().map_err(|e| gzip_err(e.clone()))?;
        let wlen = inflater.window(&mut self.window)?;
        let expect = (self.total_out - self.member_out_start).min(WINDOW_SIZE as u64) as usize;
        if wlen != expect {
            return Err(gzip_err(format!(
                "internal: inflate window has {wlen} bytes, expected {expect}"
            )));
        }
        let window_deflate = self.compress_window(wlen)?;
        self.place(Checkpoint {
            in_offset,
            bits,
            out_offset: self.total_out,
            member_start: false,
            window_deflate,
            window: None,
        });
        Ok(())
    }

    fn compress_window(&mut self, len: usize) -> Result<Vec<u8>> {
        deflate_window(&mut self.compressor, &self.window[..len])
    }

    fn step_trailer(&mut self) -> Result<()> {
        while self.avail().len() < 8 {
            if self.eof {
                return Err(gzip_err(format!(
                    "truncated trailer of gzip member {} at offset {}",
                    self.members,
                    self.pos()
                )));
            }
            self.fill()?;
        }
        let t = &self.inbuf[self.in_start..self.in_start + 8];
        let crc = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
        let isize = u32::from_le_bytes([t[4], t[5], t[6], t[7]]);
        let at = self.pos();
        let got_crc = std::mem::take(&mut self.member_crc).finalize();
        if crc != got_crc {
            return Err(gzip_err(format!(
                "CRC-32 mismatch in gzip member {} (trailer at offset {at}): stored {crc:#010x}, computed {got_crc:#010x}",
                self.members
            )));
        }
        let got_size = (self.total_out - self.member_out_start) as u32;
        if isize != got_size {
            return Err(gzip_err(format!(
                "ISIZE mismatch in gzip member {} (trailer at offset {at}): stored {isize}, actual {got_size}",
                self.members
            )));
        }
        self.in_start += 8;
        self.state = State::Header;
        Ok(())
    }

    fn step_padding(&mut self) -> Result<()> {
        if let Some(i) = self.avail().iter().position(|&b| b != 0) {
            return Err(gzip_err(format!(
                "trailing garbage after the last gzip member at offset {}",
                self.pos() + i as u64
            )));
        }
        self.in_start = self.in_end;
        if self.eof {
            self.state = State::Done;
            Ok(())
        } else {
            self.fill()
        }
    }
}

fn to_io(e: Error) -> io::Error {
    match e {
        Error::Io(e) => e,
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

impl<R: Read> Read for GzipIndexer<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.out_pos == self.out_end {
            if buf.len() >= SMALL_READ {
                return self.produce(buf).map_err(to_io);
            }
            let mut ob = std::mem::take(&mut self.outbuf);
            ob.resize(OUT_BUF_SIZE, 0);
            let r = self.produce(&mut ob);
            self.outbuf = ob;
            self.out_pos = 0;
            self.out_end = 0;
            self.out_end = r.map_err(to_io)?;
        }
        let n = buf.len().min(self.out_end - self.out_pos);
        buf[..n].copy_from_slice(&self.outbuf[self.out_pos..self.out_pos + n]);
        self.out_pos += n;
        Ok(n)
    }
}

// ---------------------------------------------------------------------------------------
// Extraction
// ---------------------------------------------------------------------------------------

/// A checkpoint's window deflated as indexes keep it (libdeflate's default level:
/// deterministic, fast, small); `compressor` is made on first use and kept for the next
/// window. An empty window stays empty.
pub(crate) fn deflate_window(
    compressor: &mut Option<libdeflater::Compressor>,
    window: &[u8],
) -> Result<Vec<u8>> {
    if window.is_empty() {
        return Ok(Vec::new());
    }
    let compressor = compressor.get_or_insert_with(|| {
        libdeflater::Compressor::new(libdeflater::CompressionLvl::default())
    });
    let mut buf = vec![0u8; compressor.deflate_compress_bound(window.len())];
    let n = compressor
        .deflate_compress(window, &mut buf)
        .map_err(|e| gzip_err(format!("compressing a checkpoint window: {e}")))?;
    buf.truncate(n);
    Ok(buf)
}

/// The raw history a deflated checkpoint window holds (at most [`WINDOW_SIZE`] bytes).
pub(crate) fn inflate_window(deflated: &[u8]) -> Result<Vec<u8>> {
    let mut raw = vec![0u8; WINDOW_SIZE];
    let n = libdeflater::Decompressor::new()
        .deflate_decompress(deflated, &mut raw)
        .map_err(|e| gzip_err(format!("checkpoint window: {e}")))?;
    raw.truncate(n);
    Ok(raw)
}

/// Decompresses uncompressed bytes `[cp.out_offset + skip, cp.out_offset + skip +
/// out.len())`, given `compressed` = the blob's bytes starting at `cp.start_byte()` (as
/// many as the caller fetched: the spans it needs).
///
/// Crosses member boundaries (skipping trailers, parsing the next header). Member CRCs
/// are not checked here (a range rarely covers a whole member): the span digests vouch
/// for the compressed bytes. Errors, never panics, when the input is too short, corrupt,
/// or the range reaches past the end of the stream.
pub fn extract(cp: &Checkpoint, compressed: &[u8], skip: u64, out: &mut [u8]) -> Result<()> {
    if cp.window.is_some() && cp.window_deflate.is_empty() {
        return Err(gzip_err(
            "the checkpoint's window is in the windows blob and was not given",
        ));
    }
    extract_with_window(cp, &cp.window_deflate, compressed, skip, out)
}

/// A checkpoint's window as the caller holds it.
#[derive(Debug, Clone, Copy)]
pub enum Window<'a> {
    /// Raw deflate, as an index stores it (empty: no history).
    Deflated(&'a [u8]),
    /// The history itself, at most [`WINDOW_SIZE`] bytes (as [`extract_capturing`]
    /// hands it out).
    Raw(&'a [u8]),
}

/// [`extract`] with the checkpoint's deflated window given by the caller (fetched from
/// the windows blob and verified against the checkpoint's [`crate::ferryidx::WindowRef`]).
pub fn extract_with_window(
    cp: &Checkpoint,
    window_deflate: &[u8],
    compressed: &[u8],
    skip: u64,
    out: &mut [u8],
) -> Result<()> {
    extract_capturing(
        cp,
        Window::Deflated(window_deflate),
        compressed,
        skip,
        out,
        &[],
        &mut |_, _| {},
    )
}

/// [`extract_with_window`] that also hands out the inflate history at output offsets
/// `capture` (relative to the checkpoint, ascending; those past the bytes this call
/// produces, `skip + out.len()`, are ignored): `take(i, window)` receives the raw window
/// at `capture[i]`, exactly what the indexer saw there. A reader passing through later
/// checkpoints thus gets their windows for nothing but a copy, where fetching them would
/// cost a request each.
pub fn extract_capturing(
    cp: &Checkpoint,
    window: Window<'_>,
    compressed: &[u8],
    skip: u64,
    out: &mut [u8],
    capture: &[u64],
    take: &mut dyn FnMut(usize, &[u8]),
) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let mut x = Extraction::start(cp, window, compressed)?;
    x.skip(compressed, skip, capture, take)?;
    x.fill(compressed, out, capture, take)
}

/// An extraction from a checkpoint that can be continued: the inflater, its history and
/// its place in the compressed bytes survive between calls, so a reader that wants the
/// first part of a span now and the next part later inflates each byte once, and never
/// inflates the part of a span nobody asks for.
///
/// Every call gets the same `compressed` (the blob's bytes from the checkpoint's
/// `start_byte()` on, as [`extract`] takes them).
pub struct Extraction {
    inf: Inflater,
    /// Next compressed byte to give the inflater.
    pos: usize,
    /// Inside a member's deflate stream (else at a member header, or at the end).
    in_member: bool,
    /// Uncompressed bytes produced since the checkpoint.
    produced: u64,
    /// The checkpoint's compressed offset, for errors.
    start_byte: u64,
}

impl std::fmt::Debug for Extraction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extraction")
            .field("pos", &self.pos)
            .field("produced", &self.produced)
            .finish()
    }
}

impl Extraction {
    /// Starts inflating at `cp` with its `window` (primes the pending bits from
    /// `compressed`'s first byte).
    pub fn start(cp: &Checkpoint, window: Window<'_>, compressed: &[u8]) -> Result<Self> {
        let mut inf = Inflater::new()?;
        let mut pos = 0usize;
        let mut in_member = false;
        if !cp.member_start {
            if cp.bits > 7 {
                return Err(gzip_err(format!(
                    "checkpoint has invalid bit count {}",
                    cp.bits
                )));
            }
            if cp.bits > 0 {
                let &b = compressed
                    .first()
                    .ok_or_else(|| gzip_err("compressed input too short for the checkpoint"))?;
                inf.prime(cp.bits, b >> (8 - cp.bits))?;
                pos = 1;
            }
            match window {
                Window::Deflated([]) => {}
                Window::Deflated(d) => inf.set_dictionary(&inflate_window(d)?)?,
                Window::Raw(r) if r.len() > WINDOW_SIZE => {
                    return Err(gzip_err(format!("a window of {} bytes", r.len())));
                }
                Window::Raw(r) => inf.set_dictionary(r)?,
            }
            in_member = true;
        }
        Ok(Extraction {
            inf,
            pos,
            in_member,
            produced: 0,
            start_byte: cp.start_byte(),
        })
    }

    /// Uncompressed bytes produced (or skipped) since the checkpoint.
    pub fn produced(&self) -> u64 {
        self.produced
    }

    /// The inflate history now (the raw window a read starting here would need).
    pub fn window(&self, buf: &mut [u8; WINDOW_SIZE]) -> Result<usize> {
        self.inf.window(buf)
    }

    /// Inflates and drops the next `n` bytes (captures on the way as [`Self::fill`]).
    pub fn skip(
        &mut self,
        compressed: &[u8],
        mut n: u64,
        capture: &[u64],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let mut scratch = Vec::new();
        while n > 0 {
            if scratch.is_empty() {
                scratch.resize(OUT_BUF_SIZE.min(n as usize), 0);
            }
            let k = n.min(scratch.len() as u64) as usize;
            self.fill(compressed, &mut scratch[..k], capture, take)?;
            n -= k as u64;
        }
        Ok(())
    }

    /// Produces the next `out.len()` bytes, crossing member boundaries (skipping
    /// trailers, parsing the next header). `take(i, window)` receives the raw history at
    /// each output offset `capture[i]` (relative to the checkpoint, ascending) this call
    /// passes or ends at. Member CRCs are not checked (a range rarely covers a whole
    /// member): the span digests vouch for the compressed bytes. Errors, never panics,
    /// when the input is too short, corrupt, or the range reaches past the end of the
    /// stream.
    pub fn fill(
        &mut self,
        compressed: &[u8],
        out: &mut [u8],
        capture: &[u64],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let end = self.produced + out.len() as u64;
        let mut next_capture = capture
            .iter()
            .position(|&c| c > self.produced)
            .unwrap_or(capture.len());
        let mut history: Option<Box<[u8; WINDOW_SIZE]>> = None;
        let mut written = 0usize;
        let short = || gzip_err("compressed input too short for the requested range");
        while written < out.len() {
            if !self.in_member {
                let rest = compressed.get(self.pos..).unwrap_or_default();
                if rest.is_empty() {
                    return Err(short());
                }
                if rest[0] == 0 {
                    return Err(gzip_err(
                        "requested range reaches past the end of the gzip stream",
                    ));
                }
                match parse_member_header(rest)? {
                    HeaderParse::Complete(len) => self.pos += len,
                    HeaderParse::Incomplete => return Err(short()),
                }
                self.inf.reset()?;
                self.in_member = true;
            }
            // Stop at the next capture point, so the history can be taken there.
            let room = match capture.get(next_capture) {
                Some(&c) if c <= end => c - self.produced,
                _ => u64::MAX,
            };
            let n = ((out.len() - written) as u64).min(room) as usize;
            let input = compressed.get(self.pos..).unwrap_or_default();
            let step = self
                .inf
                .inflate(input, &mut out[written..written + n], zsys::Z_NO_FLUSH);
            self.pos += step.consumed;
            written += step.produced;
            self.produced += step.produced as u64;
            while let Some(&c) = capture.get(next_capture) {
                if c != self.produced {
                    break;
                }
                let buf = history.get_or_insert_with(|| Box::new([0u8; WINDOW_SIZE]));
                let len = self.inf.window(buf)?;
                take(next_capture, &buf[..len]);
                next_capture += 1;
            }
            match step.code {
                zsys::Z_OK => {}
                zsys::Z_STREAM_END => {
                    let back = (step.unused_bits() / 8) as usize;
                    self.pos = self
                        .pos
                        .checked_sub(back)
                        .ok_or_else(|| gzip_err("internal: inflate over-read"))?;
                    self.in_member = false;
                    if compressed.len() - self.pos < 8 {
                        if written == out.len() {
                            // The member's trailer is past the bytes given: whatever
                            // follows is too.
                            self.pos = compressed.len();
                            break;
                        }
                        return Err(short());
                    }
                    self.pos += 8;
                }
                zsys::Z_BUF_ERROR => return Err(short()),
                _ => return Err(inflate_error(&step, self.start_byte + self.pos as u64)),
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use proptest::prelude::*;
    use std::io::Write;

    /// Small deterministic PRNG (xorshift64*).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            if n == 0 { 0 } else { self.next() % n }
        }
    }

    const WORDS: &[&str] = &[
        "layer",
        "ferry",
        "gzip",
        "tar",
        "usr/bin/",
        "lib",
        "the",
        "of",
        "index",
        "span",
        "checkpoint",
        "window",
        "container",
        "image",
        "registry",
        "\n",
        " ",
        "=",
        "0",
        "42",
    ];

    /// Mixed data: text runs, random runs, zero runs.
    fn mixed(len: usize, seed: u64) -> Vec<u8> {
        let mut r = Rng(seed | 1);
        let mut v = Vec::with_capacity(len);
        while v.len() < len {
            match r.below(3) {
                0 => {
                    for _ in 0..r.below(2000) {
                        v.extend_from_slice(WORDS[r.below(WORDS.len() as u64) as usize].as_bytes());
                    }
                }
                1 => {
                    for _ in 0..r.below(4000) {
                        v.push(r.next() as u8);
                    }
                }
                _ => v.resize(v.len() + r.below(3000) as usize, 0),
            }
        }
        v.truncate(len);
        v
    }

    fn random(len: usize, seed: u64) -> Vec<u8> {
        let mut r = Rng(seed | 1);
        (0..len).map(|_| r.next() as u8).collect()
    }

    fn gz(data: &[u8], level: u32) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::new(level));
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn index_with(blob: &[u8], span: u64, read_size: usize) -> Result<(GzipIndex, Vec<u8>)> {
        let mut ix = GzipIndexer::new(blob, span);
        let mut out = Vec::new();
        let mut buf = vec![0u8; read_size];
        loop {
            let n = ix.read(&mut buf)?;
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        Ok((ix.finish()?, out))
    }

    fn index(blob: &[u8], span: u64) -> GzipIndex {
        index_with(blob, span, 1 << 20).unwrap().0
    }

    fn span_range(idx: &GzipIndex, i: usize) -> std::ops::Range<usize> {
        let start = idx.checkpoints[i].start_byte() as usize;
        let end = match idx.checkpoints.get(i + 1) {
            Some(n) => n.in_offset as usize,
            None => idx.compressed_size as usize,
        };
        start..end
    }

    fn span_for(idx: &GzipIndex, off: u64) -> usize {
        idx.checkpoints
            .partition_point(|c| c.out_offset <= off)
            .saturating_sub(1)
    }

    fn read_range(idx: &GzipIndex, blob: &[u8], off: u64, len: usize) -> Result<Vec<u8>> {
        let first = span_for(idx, off);
        let last = span_for(idx, off + len.max(1) as u64 - 1);
        let cp = &idx.checkpoints[first];
        let start = cp.start_byte() as usize;
        let end = span_range(idx, last).end;
        let mut out = vec![0u8; len];
        extract(cp, &blob[start..end], off - cp.out_offset, &mut out)?;
        Ok(out)
    }

    /// Full check of one blob against its uncompressed content.
    fn check(blob: &[u8], orig: &[u8], span: u64, seed: u64) -> GzipIndex {
        let (idx, out) = index_with(blob, span, 1 << 20).unwrap();
        assert_eq!(out.len(), orig.len());
        assert!(out == orig, "decompressed stream differs");
        assert_eq!(idx.uncompressed_size, orig.len() as u64);
        assert_eq!(idx.compressed_size, blob.len() as u64);
        assert_eq!(idx.blob_sha256, <[u8; 32]>::from(Sha256::digest(blob)));
        assert_eq!(idx.checkpoints.len(), idx.span_digests.len());
        let cp0 = &idx.checkpoints[0];
        assert!(cp0.member_start && cp0.in_offset == 0 && cp0.out_offset == 0);
        for w in idx.checkpoints.windows(2) {
            assert!(w[1].out_offset - w[0].out_offset >= span.max(1));
            assert!(w[1].in_offset >= w[0].in_offset);
        }
        for (i, cp) in idx.checkpoints.iter().enumerate() {
            if i > 0 {
                assert!(
                    cp.out_offset < idx.uncompressed_size,
                    "checkpoint at the end"
                );
            }
            assert!(cp.bits < 8);
            if cp.member_start {
                assert!(cp.window_deflate.is_empty() && cp.bits == 0);
            }
            let want: [u8; 32] = Sha256::digest(&blob[span_range(&idx, i)]).into();
            assert_eq!(idx.span_digests[i], want, "span digest {i}");
        }
        // Determinism, also across read sizes (small reads use the internal buffer).
        let (again, out2) = index_with(blob, span, 4093).unwrap();
        assert_eq!(again, idx);
        assert!(out2 == orig);
        // Random ranges.
        let mut r = Rng(seed | 1);
        let total = orig.len() as u64;
        for k in 0..60 {
            if total == 0 {
                break;
            }
            let off = r.below(total);
            let max = (total - off).min(if k % 4 == 0 { 3 * span.max(1) } else { 70_000 });
            let len = 1 + r.below(max) as usize;
            let got = read_range(&idx, blob, off, len).unwrap();
            assert!(
                got[..] == orig[off as usize..off as usize + len],
                "range {off}+{len}"
            );
        }
        // Every checkpoint restarts correctly on its own span.
        for (i, cp) in idx.checkpoints.iter().enumerate() {
            let end = idx.checkpoints.get(i + 1).map_or(total, |n| n.out_offset);
            let len = (end - cp.out_offset) as usize;
            let mut out = vec![0u8; len];
            extract(cp, &blob[span_range(&idx, i)], 0, &mut out).unwrap();
            assert!(
                out[..] == orig[cp.out_offset as usize..end as usize],
                "span {i}"
            );
        }
        idx
    }

    #[test]
    fn single_member_levels_and_sizes() {
        for &level in &[0u32, 1, 6, 9] {
            for &size in &[0usize, 1, 100, 65_535, 65_536, 300_000, 2_000_000] {
                let orig = mixed(size, size as u64 + u64::from(level));
                let blob = gz(&orig, level);
                check(&blob, &orig, 64 * 1024, 7);
            }
        }
    }

    #[test]
    fn random_data_stored_blocks() {
        for &level in &[0u32, 6] {
            let orig = random(1_500_000, 99);
            let blob = gz(&orig, level);
            let idx = check(&blob, &orig, 64 * 1024, 3);
            assert!(idx.checkpoints.len() > 10);
        }
    }

    #[test]
    fn multi_member_with_empty_members() {
        let parts: Vec<(Vec<u8>, u32)> = vec![
            (mixed(200_000, 1), 6),
            (Vec::new(), 6),
            (random(70_000, 2), 1),
            (mixed(1_000_000, 3), 9),
            (Vec::new(), 0),
            (mixed(5, 4), 0),
            (mixed(500_000, 5), 6),
            (Vec::new(), 9),
        ];
        let mut blob = Vec::new();
        let mut orig = Vec::new();
        for (p, l) in &parts {
            blob.extend_from_slice(&gz(p, *l));
            orig.extend_from_slice(p);
        }
        for &span in &[1u64, 1000, 64 * 1024, 300_000, DEFAULT_SPAN] {
            let idx = check(&blob, &orig, span, span);
            if span == 1 {
                assert!(idx.checkpoints.iter().filter(|c| c.member_start).count() >= 2);
            }
        }
    }

    /// Inflating from a checkpoint through later ones hands out, at each, the window the
    /// indexer stored there, across members and whether the extraction starts by
    /// skipping or not; a read starting from such a raw window gets the stream's bytes.
    #[test]
    fn extraction_captures_the_windows_of_the_checkpoints_it_passes() {
        let mut blob = gz(&mixed(900_000, 7), 6);
        blob.extend_from_slice(&gz(&random(50_000, 8), 1));
        blob.extend_from_slice(&gz(&mixed(700_000, 9), 9));
        let idx = index(&blob, 64 * 1024);
        let cps = &idx.checkpoints;
        assert!(cps.len() > 12, "{}", cps.len());
        for (first, skip) in [(0usize, 0u64), (1, 0), (3, 5_000)] {
            let cp = &cps[first];
            let at: Vec<u64> = cps[first + 1..]
                .iter()
                .filter(|c| !c.member_start)
                .map(|c| c.out_offset - cp.out_offset)
                .collect();
            let len = (idx.uncompressed_size - cp.out_offset - skip) as usize;
            let mut out = vec![0u8; len];
            let mut got: Vec<(usize, Vec<u8>)> = Vec::new();
            let start = cp.start_byte() as usize;
            extract_capturing(
                cp,
                Window::Deflated(&cp.window_deflate),
                &blob[start..],
                skip,
                &mut out,
                &at,
                &mut |i, w| got.push((i, w.to_vec())),
            )
            .unwrap();
            assert_eq!(got.len(), at.len(), "every capture point reached");
            for (i, raw) in got {
                let want = cps
                    .iter()
                    .find(|c| !c.member_start && c.out_offset == cp.out_offset + at[i])
                    .unwrap();
                let indexed = inflate_window(&want.window_deflate).unwrap();
                assert!(raw == indexed, "checkpoint at {}", at[i]);
                // A read starting there from the raw window gets the stream's bytes.
                let at_out = (want.out_offset - cp.out_offset - skip) as usize;
                let take = 1000.min(out.len() - at_out);
                let mut from_raw = vec![0u8; take];
                let wstart = want.start_byte() as usize;
                extract_capturing(
                    want,
                    Window::Raw(&raw),
                    &blob[wstart..],
                    0,
                    &mut from_raw,
                    &[],
                    &mut |_, _| {},
                )
                .unwrap();
                assert!(from_raw[..] == out[at_out..at_out + take]);
            }
            // The bytes are those of a plain extraction.
            let mut plain = vec![0u8; len];
            extract(cp, &blob[start..], skip, &mut plain).unwrap();
            assert!(out == plain);
        }
        // A capture past the produced bytes is not reported.
        let cp = &cps[0];
        let mut out = vec![0u8; 1000];
        let mut n = 0;
        extract_capturing(
            cp,
            Window::Deflated(&[]),
            &blob,
            0,
            &mut out,
            &[500, 2000],
            &mut |_, _| n += 1,
        )
        .unwrap();
        assert_eq!(n, 1);
    }

    #[test]
    fn many_small_members_like_estargz() {
        let mut blob = Vec::new();
        let mut orig = Vec::new();
        for i in 0..200u64 {
            let p = mixed((i * 997 % 5000) as usize, i);
            blob.extend_from_slice(&gz(&p, 6));
            orig.extend_from_slice(&p);
        }
        let idx = check(&blob, &orig, 4096, 11);
        assert!(idx.checkpoints.iter().all(|c| c.member_start));
        check(&blob, &orig, 1, 12);
    }

    /// Sync flushes (pigz, eStargz writers) leave empty stored blocks: block boundaries
    /// without progress, and one right at the end of the stream, which must not become a
    /// checkpoint.
    #[test]
    fn sync_flushed_members() {
        let orig = mixed(400_000, 90);
        let mut blob = Vec::new();
        for (i, chunk) in orig.chunks(37_000).enumerate() {
            let mut e = GzEncoder::new(Vec::new(), Compression::new(6));
            e.flush().unwrap();
            for piece in chunk.chunks(5000 + i * 100) {
                e.write_all(piece).unwrap();
                e.flush().unwrap();
                e.flush().unwrap();
            }
            blob.extend_from_slice(&e.finish().unwrap());
        }
        for &span in &[1u64, 4999, 5000, 64 * 1024] {
            check(&blob, &orig, span, span);
        }
    }

    #[test]
    fn only_empty_members() {
        let mut blob = gz(&[], 6);
        blob.extend_from_slice(&gz(&[], 1));
        let idx = check(&blob, &[], 10, 1);
        assert_eq!(idx.checkpoints.len(), 1);
        assert_eq!(idx.uncompressed_size, 0);
    }

    #[test]
    fn trailing_zero_padding_accepted() {
        let orig = mixed(400_000, 8);
        let mut blob = gz(&orig, 6);
        blob.extend_from_slice(&[0u8; 1000]);
        let idx = check(&blob, &orig, 64 * 1024, 5);
        assert_eq!(idx.compressed_size, blob.len() as u64);
    }

    /// Greedy selection over all candidates (obtained with span 1) gives the checkpoints
    /// of any span: the placement rule does not depend on how inflate was driven.
    #[test]
    fn placement_is_greedy_over_candidates() {
        let mut blob = gz(&mixed(2_000_000, 21), 6);
        blob.extend_from_slice(&gz(&random(300_000, 22), 1));
        blob.extend_from_slice(&gz(&mixed(1_000_000, 23), 9));
        let all = index(&blob, 1);
        for &span in &[2u64, 5000, 64 * 1024, 100_000, 1 << 20] {
            let mut want: Vec<&Checkpoint> = vec![&all.checkpoints[0]];
            for c in &all.checkpoints[1..] {
                if c.out_offset - want.last().unwrap().out_offset >= span {
                    want.push(c);
                }
            }
            let got = index(&blob, span);
            let got: Vec<&Checkpoint> = got.checkpoints.iter().collect();
            assert_eq!(got, want, "span {span}");
        }
    }

    #[test]
    fn header_fields_are_skipped() {
        let orig = mixed(100_000, 30);
        let body = gz(&orig, 6);
        // Rebuild the member with FEXTRA, FNAME, FCOMMENT and FHCRC.
        let mut h = vec![
            0x1f,
            0x8b,
            8,
            FEXTRA | FNAME | FCOMMENT | FHCRC,
            1,
            2,
            3,
            4,
            0,
            3,
        ];
        h.extend_from_slice(&5u16.to_le_bytes());
        h.extend_from_slice(b"ab\x00cd");
        h.extend_from_slice(b"name.tar\x00");
        h.extend_from_slice(b"a comment\x00");
        let c = crc32fast::hash(&h) as u16;
        h.extend_from_slice(&c.to_le_bytes());
        assert_eq!(
            parse_member_header(&h).unwrap(),
            HeaderParse::Complete(h.len())
        );
        for i in 0..h.len() {
            assert_eq!(
                parse_member_header(&h[..i]).unwrap(),
                HeaderParse::Incomplete
            );
        }
        let mut blob = h.clone();
        blob.extend_from_slice(&body[10..]);
        blob.extend_from_slice(&h);
        blob.extend_from_slice(&body[10..]);
        let mut both = orig.clone();
        both.extend_from_slice(&orig);
        check(&blob, &both, 30_000, 31);
        // Wrong header CRC.
        let mut bad = blob.clone();
        bad[h.len() - 1] ^= 1;
        assert!(index_with(&bad, 1000, 1 << 16).is_err());
    }

    #[test]
    fn header_parser_rejects_bad_input() {
        let ok = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];
        assert_eq!(parse_member_header(&ok).unwrap(), HeaderParse::Complete(10));
        assert!(parse_member_header(&[0x1f, 0x8c]).is_err());
        assert!(parse_member_header(&[0x00]).is_err());
        assert!(parse_member_header(&[0x1f, 0x8b, 7]).is_err());
        for f in [0x20u8, 0x40, 0x80] {
            let mut b = ok;
            b[3] = f;
            assert!(parse_member_header(&b).is_err());
        }
        // Huge FEXTRA length: incomplete until the bytes are there.
        let mut b = ok.to_vec();
        b[3] = FEXTRA;
        b.extend_from_slice(&[0xff, 0xff]);
        assert_eq!(parse_member_header(&b).unwrap(), HeaderParse::Incomplete);
        // Unterminated file name longer than the limit.
        let mut b = ok.to_vec();
        b[3] = FNAME;
        b.resize(10 + MAX_HEADER_STRING, b'a');
        assert!(parse_member_header(&b).is_err());
        b.truncate(10 + MAX_HEADER_STRING - 1);
        assert_eq!(parse_member_header(&b).unwrap(), HeaderParse::Incomplete);
        b.push(0);
        assert_eq!(
            parse_member_header(&b).unwrap(),
            HeaderParse::Complete(b.len())
        );
    }

    fn must_fail(blob: &[u8], what: &str) {
        let r = index_with(blob, 8192, 1 << 16);
        assert!(r.is_err(), "{what}: accepted");
        // The Read side reports the same error, as InvalidData with the gzip text.
        let mut ix = GzipIndexer::new(blob, 8192);
        let mut sink = Vec::new();
        if let Err(e) = ix.read_to_end(&mut sink) {
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{what}: {e}");
            assert!(e.to_string().starts_with("gzip: "), "{what}: {e}");
            // Sticky.
            assert!(ix.read(&mut [0u8; 10]).is_err());
        }
        assert!(ix.finish().is_err());
    }

    #[test]
    fn corruption_is_an_error() {
        let orig = mixed(300_000, 40);
        let blob = gz(&orig, 6);
        must_fail(&[], "empty");
        must_fail(&blob[..blob.len() - 1], "truncated trailer");
        must_fail(&blob[..blob.len() - 8], "no trailer");
        must_fail(&blob[..blob.len() / 2], "truncated data");
        must_fail(&blob[..5], "truncated header");
        let n = blob.len();
        let mut b = blob.clone();
        b[n - 8] ^= 1;
        must_fail(&b, "bad CRC");
        let mut b = blob.clone();
        b[n - 4] ^= 1;
        must_fail(&b, "bad ISIZE");
        let mut b = blob.clone();
        b[3] = 0x20;
        must_fail(&b, "reserved flag");
        let mut b = gz(&orig[..1000], 6);
        b[3] = FEXTRA;
        b[10] = 0xff;
        b[11] = 0xff;
        must_fail(&b, "huge FEXTRA");
        let mut b = blob.clone();
        b.extend_from_slice(b"garbage");
        must_fail(&b, "trailing garbage");
        let mut b = blob.clone();
        b.extend_from_slice(&[0, 0, 0, 1]);
        must_fail(&b, "garbage after padding");
        let mut b = blob.clone();
        b.extend_from_slice(&[0x1f, 0x8b]);
        must_fail(&b, "truncated second member");
        // Flipped bits: an error (deflate error, CRC, ISIZE) unless the flip is harmless
        // (MTIME/XFL/OS, FTEXT, padding bits of the last deflate byte): then the content
        // must be intact.
        let mut r = Rng(77);
        let mut caught = 0;
        for _ in 0..300 {
            let mut b = blob.clone();
            let i = r.below(n as u64) as usize;
            b[i] ^= 1 << r.below(8);
            match index_with(&b, 8192, 1 << 16) {
                Err(_) => caught += 1,
                Ok((_, out)) => assert!(out == orig, "flip at {i} accepted with other content"),
            }
        }
        assert!(caught > 250, "only {caught} of 300 flips caught");
    }

    #[test]
    fn extract_errors_instead_of_panicking() {
        let orig = mixed(500_000, 50);
        let blob = gz(&orig, 6);
        let idx = index(&blob, 64 * 1024);
        let mut out = vec![0u8; 1000];
        for (i, cp) in idx.checkpoints.iter().enumerate() {
            let r = span_range(&idx, i);
            // Too short.
            let cut = &blob[r.start..r.start + (r.len() / 3)];
            assert!(extract(cp, cut, (orig.len() as u64 - cp.out_offset) / 2, &mut out).is_err());
            assert!(extract(cp, &[], 0, &mut out).is_err());
            // Past the end of the stream.
            let tail = &blob[r.start..];
            let past = orig.len() as u64 - cp.out_offset - 10;
            assert!(extract(cp, tail, past, &mut out).is_err());
            assert!(extract(cp, tail, past, &mut out[..10]).is_ok());
            assert!(out[..10] == orig[orig.len() - 10..]);
            // Corrupt window / bits.
            let mut bad = cp.clone();
            if !bad.member_start {
                bad.window_deflate = vec![0xff; 10];
                assert!(extract(&bad, tail, 0, &mut out).is_err());
                bad.bits = 9;
                assert!(extract(&bad, tail, 0, &mut out).is_err());
            }
        }
        // A default checkpoint over garbage.
        let _ = extract(&Checkpoint::default(), &[0xff; 100], 5, &mut out);
        let _ = extract(&Checkpoint::default(), &blob, 0, &mut out);
    }

    #[test]
    fn small_reads_and_finish_without_reading() {
        let orig = mixed(700_000, 60);
        let blob = gz(&orig, 6);
        let full = index(&blob, 64 * 1024);
        // finish() without reading anything.
        let idx = GzipIndexer::new(&blob[..], 64 * 1024).finish().unwrap();
        assert_eq!(idx, full);
        // Read part, then finish.
        let mut ix = GzipIndexer::new(&blob[..], 64 * 1024);
        let mut head = vec![0u8; 1234];
        ix.read_exact(&mut head).unwrap();
        assert!(head[..] == orig[..1234]);
        assert_eq!(ix.uncompressed_offset(), 1234);
        assert_eq!(ix.finish().unwrap(), full);
        // One-byte reads.
        let small = mixed(20_000, 61);
        let sblob = gz(&small, 6);
        let (a, out) = index_with(&sblob, 1000, 1).unwrap();
        assert!(out == small);
        assert_eq!(a, index(&sblob, 1000));
    }

    /// A reader that returns at most `n` bytes per call (like a network socket).
    struct Trickle<'a>(&'a [u8], usize);
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.1).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn trickling_input_gives_the_same_index() {
        let mut blob = gz(&mixed(600_000, 70), 6);
        blob.extend_from_slice(&gz(&mixed(100_000, 71), 1));
        blob.extend_from_slice(&[0; 3]);
        let full = index(&blob, 50_000);
        for chunk in [1usize, 7, 1000] {
            let mut ix = GzipIndexer::new(Trickle(&blob, chunk), 50_000);
            io::copy(&mut ix, &mut io::sink()).unwrap();
            assert_eq!(ix.finish().unwrap(), full, "chunk {chunk}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        #[test]
        fn prop_index_and_extract(
            parts in prop::collection::vec((0usize..100_000, 0u32..10, any::<u64>(), any::<bool>()), 1..5),
            span in 1u64..200_000,
            seed in any::<u64>(),
        ) {
            let mut blob = Vec::new();
            let mut orig = Vec::new();
            for (len, level, s, rand) in parts {
                let p = if rand { random(len, s) } else { mixed(len, s) };
                blob.extend_from_slice(&gz(&p, level));
                orig.extend_from_slice(&p);
            }
            check(&blob, &orig, span, seed);
        }

        #[test]
        fn prop_garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..4096), span in 0u64..5000) {
            let _ = parse_member_header(&bytes);
            let _ = index_with(&bytes, span, 1000);
            let mut out = [0u8; 300];
            let _ = extract(&Checkpoint::default(), &bytes, 0, &mut out);
        }

        #[test]
        fn prop_mutated_gzip_never_panics(flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4), seed in any::<u64>()) {
            let orig = mixed(30_000, seed);
            let mut blob = gz(&orig, 6);
            for (i, x) in flips {
                let n = blob.len();
                blob[i % n] ^= x;
            }
            if let Ok((idx, out)) = index_with(&blob, 2000, 1 << 16) {
                // Accepted only if the content is intact (flip in MTIME/XFL/OS or x = 0).
                prop_assert!(out == orig);
                prop_assert_eq!(idx.uncompressed_size, orig.len() as u64);
            }
        }
    }

    /// CPU seconds (user + system) of this process and of its waited-for children,
    /// from `/proc/self/stat` (clock ticks of 10 ms).
    fn cpu_seconds() -> (f64, f64) {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
        let f: Vec<f64> = after
            .split_whitespace()
            .map(|x| x.parse().unwrap_or(0.0))
            .collect();
        // Fields after the command: state=0, ..., utime=11, stime=12, cutime=13, cstime=14.
        let tick = 100.0;
        if f.len() < 15 {
            return (0.0, 0.0);
        }
        ((f[11] + f[12]) / tick, (f[13] + f[14]) / tick)
    }

    /// Times indexing against `gzip -dc` on ~200 MB of mixed data (wall clock and CPU
    /// time, so a busy machine does not hide the ratio). Run with
    /// `cargo test --release -p ferry-index --lib zran -- --ignored --nocapture`;
    /// `FERRY_BENCH_MB` sets the size, `FERRY_BENCH_GZ` uses an existing .gz instead,
    /// `FERRY_BENCH_SPANS` (comma-separated bytes) the spans, `FERRY_BENCH_READ` the size
    /// of each `read` call.
    #[test]
    #[ignore]
    fn bench_index_vs_gzip() {
        use std::process::{Command, Stdio};
        use std::time::Instant;
        let dir = tempfile::tempdir().unwrap();
        let gzp = match std::env::var_os("FERRY_BENCH_GZ") {
            Some(p) => std::path::PathBuf::from(p),
            None => {
                let raw = dir.path().join("data");
                let size = std::env::var("FERRY_BENCH_MB")
                    .ok()
                    .and_then(|s| s.parse::<usize>().ok())
                    .unwrap_or(200)
                    << 20;
                std::fs::write(&raw, bench_data(size)).unwrap();
                let t = Instant::now();
                let st = Command::new("gzip")
                    .args(["-6", "-f"])
                    .arg(&raw)
                    .status()
                    .unwrap();
                assert!(st.success());
                eprintln!("gzip -6 of {} MiB: {:.2?}", size >> 20, t.elapsed());
                dir.path().join("data.gz")
            }
        };
        let csize = std::fs::metadata(&gzp).unwrap().len();
        let gzip_dc = || {
            let (_, c0) = cpu_seconds();
            let t = Instant::now();
            let st = Command::new("gzip")
                .arg("-dc")
                .arg(&gzp)
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(st.success());
            (t.elapsed().as_secs_f64(), cpu_seconds().1 - c0)
        };
        let read_size = std::env::var("FERRY_BENCH_READ")
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or(1 << 20)
            .max(1);
        let ours = |span: u64| {
            let (c0, _) = cpu_seconds();
            let t = Instant::now();
            let f = std::fs::File::open(&gzp).unwrap();
            let mut ix = GzipIndexer::new(f, span);
            let mut buf = vec![0u8; read_size];
            while ix.read(&mut buf).unwrap() > 0 {}
            let idx = ix.finish().unwrap();
            (t.elapsed().as_secs_f64(), cpu_seconds().0 - c0, idx)
        };
        let (_, _, idx) = ours(DEFAULT_SPAN);
        let usize_ = idx.uncompressed_size;
        eprintln!(
            "blob: {csize} bytes compressed, {usize_} uncompressed ({:.1}%)",
            100.0 * csize as f64 / usize_ as f64
        );
        let spans: Vec<u64> = std::env::var("FERRY_BENCH_SPANS")
            .ok()
            .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_else(|| vec![DEFAULT_SPAN, 1 << 20, 64 << 10]);
        for round in 0..3 {
            let (gw, gc) = gzip_dc();
            let mut line = format!("round {round}: gzip -dc {gw:.2}s wall {gc:.2}s cpu");
            for &span in &spans {
                let (w, c, idx) = ours(span);
                line += &format!(
                    " | span {} KiB: {w:.2}s wall {c:.2}s cpu, {} cps, cpu ratio {:.2}, wall ratio {:.2}",
                    span >> 10,
                    idx.checkpoints.len(),
                    c / gc,
                    w / gw
                );
            }
            eprintln!("{line}");
        }
    }

    /// Tar-like mix: text "files", structured binary "files", a little random data,
    /// zero runs (tar padding); gzip -6 makes about 30-35 % of it.
    fn bench_data(len: usize) -> Vec<u8> {
        let mut r = Rng(0x5eed);
        let mut v = Vec::with_capacity(len + 70_000);
        while v.len() < len {
            match r.below(20) {
                0..=9 => {
                    let n = 1000 + r.below(60_000) as usize;
                    let end = v.len() + n;
                    while v.len() < end {
                        v.extend_from_slice(WORDS[r.below(WORDS.len() as u64) as usize].as_bytes());
                        if r.below(8) == 0 {
                            v.extend_from_slice(format!("{}", r.below(100_000)).as_bytes());
                        }
                    }
                }
                10..=16 => {
                    // "Machine code": repeated short patterns with some noise.
                    let n = 1000 + r.below(60_000) as usize;
                    let end = v.len() + n;
                    while v.len() < end {
                        let x = r.next();
                        if x & 7 == 0 {
                            let back = 1 + (x >> 8) as usize % v.len().clamp(1, 4096);
                            let start = v.len().saturating_sub(back);
                            let l = 3 + (x >> 24) as usize % 20;
                            for k in 0..l {
                                let b = v.get(start + k).copied().unwrap_or(0);
                                v.push(b);
                            }
                        } else {
                            v.push((x >> 8) as u8 & 0x3f);
                        }
                    }
                }
                17 => {
                    let n = 1000 + r.below(30_000) as usize;
                    v.extend((0..n).map(|_| r.next() as u8));
                }
                _ => v.resize(v.len() + r.below(8192) as usize, 0),
            }
        }
        v.truncate(len);
        v
    }
}
