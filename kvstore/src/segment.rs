//! Segment files of the tensor log, and their accounting records.
//!
//! A [`Segment`] is shared as an `Arc`: readers clone it for the duration of a read. When the
//! merger retires a segment it marks it obsolete and drops its own reference; the file is
//! unlinked by `Drop` once the last reader is done, so a read in flight never loses its file.
//!
//! Accounting record (column family `segments`, key: segment id as u64 big-endian), version 1,
//! 40 bytes little-endian:
//!
//! | offset | size | field                                                   |
//! |-------:|-----:|---------------------------------------------------------|
//! | 0      | 1    | format version (`1`)                                    |
//! | 1      | 1    | flags: bit 0 sealed (no more appends)                   |
//! | 2      | 6    | reserved, zero                                          |
//! | 8      | 8    | committed length: bytes covered by committed index data |
//! | 16     | 8    | live bytes (records the index points at)                |
//! | 24     | 8    | dead bytes (records deleted or moved away)              |
//! | 32     | 8    | live record count                                       |
//!
//! The committed length is written in the same index batch as the locations of the records it
//! covers. On open, anything in the file past it was never committed and is cut off.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::record::{ALIGN, SEGMENT_HEADER_LEN};

/// An open segment file.
#[derive(Debug)]
pub(crate) struct Segment {
    pub id: u64,
    pub path: PathBuf,
    /// Reads, buffered appends, syncs.
    pub file: File,
    /// A second descriptor opened with `O_DIRECT` for large appends, opened on the first one
    /// and closed when the segment is sealed; `Err` holds why the file system refused it.
    direct: Mutex<Option<std::result::Result<File, String>>>,
    obsolete: AtomicBool,
}

impl Segment {
    pub fn new(id: u64, path: PathBuf, file: File) -> Self {
        Segment {
            id,
            path,
            file,
            direct: Mutex::new(None),
            obsolete: AtomicBool::new(false),
        }
    }

    /// Writes `buf` at `offset` bypassing the page cache (`O_DIRECT`): no copy into the page
    /// cache, and no dirty pages left for write-back to throttle later writers. `buf` must
    /// start on an [`ALIGN`]-byte boundary in memory, and its length and `offset` must be
    /// multiples of [`ALIGN`]. The data then sits in the device (or its volatile cache): the
    /// caller syncs as its policy says, as after a buffered write.
    ///
    /// [`Direct::Unavailable`] says why the file system refused `O_DIRECT` or the alignment
    /// (`EINVAL`); nothing was written and the caller writes through the page cache instead.
    /// Other failures (no space, I/O errors) are errors.
    pub fn write_direct_at(&self, buf: &[u8], offset: u64) -> Result<Direct> {
        assert!(
            (buf.as_ptr() as usize).is_multiple_of(ALIGN)
                && buf.len().is_multiple_of(ALIGN)
                && offset.is_multiple_of(ALIGN as u64),
            "unaligned direct write"
        );
        let mut direct = self.direct.lock();
        let opened = direct.get_or_insert_with(|| {
            OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&self.path)
                .map_err(|e| format!("opening {} with O_DIRECT: {e}", self.path.display()))
        });
        let file = match opened {
            Ok(f) => f,
            Err(why) => return Ok(Direct::Unavailable(why.clone())),
        };
        match file.write_all_at(buf, offset) {
            Ok(()) => Ok(Direct::Written),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Direct::Unavailable(format!(
                "direct write to {}: {e}",
                self.path.display()
            ))),
            Err(e) => Err(Error::Io(std::io::Error::new(
                e.kind(),
                format!(
                    "direct write of {} bytes to {} at {offset}: {e}",
                    buf.len(),
                    self.path.display()
                ),
            ))),
        }
    }

    /// Closes the direct-I/O descriptor (the segment is sealed: no more appends).
    pub fn close_direct(&self) {
        self.direct.lock().take();
    }

    /// Reads exactly `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("reading {} at {offset}: {e}", self.path.display()),
            ))
        })
    }

    /// Reads into `buf` what of the bytes at `offset` the page cache already holds, without
    /// waiting for the disk (`preadv2` with `RWF_NOWAIT`): the count read, from 0 (the first
    /// page is not cached, or the kernel cannot tell without blocking) to `buf.len()`. Never
    /// an error: whatever this does not read is read the ordinary way.
    pub fn read_cached_at(&self, offset: u64, buf: &mut [u8]) -> usize {
        let fd = std::os::unix::io::AsRawFd::as_raw_fd(&self.file);
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut buf[done..];
            let iov = libc::iovec {
                iov_base: rest.as_mut_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            };
            // SAFETY: one iovec over `rest`, a writable buffer that outlives the call; `fd`
            // is open for as long as `self` lives.
            let r = unsafe {
                libc::preadv2(
                    fd,
                    &iov,
                    1,
                    (offset + done as u64) as libc::off_t,
                    libc::RWF_NOWAIT,
                )
            };
            match r {
                r if r > 0 => done += r as usize,
                -1 if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {
                }
                _ => break,
            }
        }
        done
    }

    /// Fills the buffers of `iovs`, in order, from the bytes at `offset` (`preadv`, batched to
    /// the system's iovec limit, resumed after short reads). `iovs` is consumed.
    pub fn read_vectored_at(&self, mut offset: u64, iovs: &mut [libc::iovec]) -> Result<()> {
        const MAX_IOV: usize = 1024;
        let fd = std::os::unix::io::AsRawFd::as_raw_fd(&self.file);
        let mut i = 0;
        while i < iovs.len() {
            let n = (iovs.len() - i).min(MAX_IOV);
            // SAFETY: the iovecs describe valid, writable, disjoint buffers (the caller's
            // contract) and `fd` is open for as long as `self` lives.
            let r = unsafe {
                libc::preadv(
                    fd,
                    iovs[i..].as_ptr(),
                    n as libc::c_int,
                    offset as libc::off_t,
                )
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Io(std::io::Error::new(
                    e.kind(),
                    format!("reading {} at {offset}: {e}", self.path.display()),
                )));
            }
            if r == 0 {
                return Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("reading {} at {offset}: end of file", self.path.display()),
                )));
            }
            let mut r = r as usize;
            offset += r as u64;
            while r > 0 {
                let v = &mut iovs[i];
                if r >= v.iov_len {
                    r -= v.iov_len;
                    i += 1;
                } else {
                    // SAFETY: advancing within the same buffer.
                    v.iov_base = unsafe { (v.iov_base as *mut u8).add(r) } as *mut libc::c_void;
                    v.iov_len -= r;
                    r = 0;
                }
            }
            // Skip empty buffers so a zero-length tail cannot look like end of file.
            while i < iovs.len() && iovs[i].iov_len == 0 {
                i += 1;
            }
        }
        Ok(())
    }

    /// Tells the kernel that `len` bytes at `offset` are about to be read, so that it queues
    /// them all at once instead of growing its readahead window step by step. Advisory: a
    /// failure only costs the speed-up.
    pub fn will_need(&self, offset: u64, len: usize) {
        let fd = std::os::unix::io::AsRawFd::as_raw_fd(&self.file);
        // SAFETY: fadvise on a descriptor that is open for as long as `self` lives.
        unsafe {
            libc::posix_fadvise(
                fd,
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
    }

    /// Marks the file for unlinking when the last reference is dropped.
    pub fn retire(&self) {
        self.obsolete.store(true, Ordering::Release);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.obsolete.load(Ordering::Acquire) {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(segment = self.id, path = %self.path.display(), error = %e, "could not unlink retired segment");
            }
        }
    }
}

/// Outcome of [`Segment::write_direct_at`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Direct {
    Written,
    /// Direct I/O is not available here, with the reason.
    Unavailable(String),
}

/// File name of segment `id`.
pub(crate) fn file_name(id: u64) -> String {
    format!("{id:016x}.tlog")
}

/// Parses [`file_name`].
pub(crate) fn parse_file_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".tlog")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

pub(crate) fn path_of(dir: &Path, id: u64) -> PathBuf {
    dir.join(file_name(id))
}

/// Accounting of one segment; see the module docs for its encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct SegmentMeta {
    pub sealed: bool,
    pub len: u64,
    pub live_bytes: u64,
    pub dead_bytes: u64,
    pub live_records: u64,
}

const META_LEN: usize = 40;

impl SegmentMeta {
    pub fn fresh() -> Self {
        SegmentMeta {
            len: SEGMENT_HEADER_LEN as u64,
            ..Default::default()
        }
    }

    pub fn encode(&self) -> [u8; META_LEN] {
        let mut b = [0u8; META_LEN];
        b[0] = 1;
        b[1] = self.sealed as u8;
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.live_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.dead_bytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.live_records.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        if b.len() < META_LEN {
            return Err(format!("segment meta truncated ({} bytes)", b.len()));
        }
        if b[0] != 1 {
            return Err(format!("unsupported segment meta version {}", b[0]));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Ok(SegmentMeta {
            sealed: b[1] & 1 == 1,
            len: u64_at(8),
            live_bytes: u64_at(16),
            dead_bytes: u64_at(24),
            live_records: u64_at(32),
        })
    }

    /// Share of the record bytes that are dead.
    pub fn dead_ratio(&self) -> f64 {
        let total = self.live_bytes + self.dead_bytes;
        if total == 0 {
            0.0
        } else {
            self.dead_bytes as f64 / total as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips() {
        let m = SegmentMeta {
            sealed: true,
            len: 1 << 33,
            live_bytes: 5,
            dead_bytes: 7,
            live_records: 2,
        };
        assert_eq!(SegmentMeta::decode(&m.encode()), Ok(m));
        assert!(SegmentMeta::decode(&m.encode()[..10]).is_err());
    }

    #[test]
    fn names_round_trip() {
        assert_eq!(parse_file_name(&file_name(0xabc)), Some(0xabc));
        assert_eq!(parse_file_name("LOCK"), None);
        assert_eq!(parse_file_name("00000000000000zz.tlog"), None);
    }

    #[test]
    fn retired_segment_is_unlinked_after_last_reader() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file_name(1));
        std::fs::write(&path, b"0123456789").unwrap();
        let seg = std::sync::Arc::new(Segment::new(1, path.clone(), File::open(&path).unwrap()));
        let reader = seg.clone();
        seg.retire();
        drop(seg);
        assert!(path.exists(), "a reader still holds it");
        let mut b = [0u8; 4];
        reader.read_at(3, &mut b).unwrap();
        assert_eq!(&b, b"3456");
        drop(reader);
        assert!(!path.exists());
    }
}
