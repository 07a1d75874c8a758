//! GGUF files read by ragkv itself: the header (metadata and the tensor table) is parsed here
//! rather than by candle's reader, which refuses a whole file for one tensor type it does not
//! know. Tensors of the types candle reads are handed to it unchanged; the non-linear 4-bit
//! types llama.cpp's users download (`IQ4_NL`, and `IQ4_XS`, whose tensors fall back to
//! `IQ4_NL` where a row is not a multiple of 256) come out as `IQ4_NL` blocks for the CPU's
//! repacked kernels ([`GgufFile::iq4_nl_blocks`]) or as `Q8_0` blocks of the same values for
//! every other path ([`GgufFile::tensor`], [`crate::quant::iq4`]); any other type is refused
//! with its name.
//!
//! The layout (GGUF v2 and v3, little-endian; v1 with 32-bit lengths):
//!
//! | field | type |
//! |---|---|
//! | magic | `GGUF` |
//! | version | u32 (1, 2 or 3) |
//! | tensor count, metadata count | u64 each (u32 in v1) |
//! | metadata | key (string), value type (u32), value |
//! | tensor table | name (string), dims `n` (u32), `n` sizes innermost first (u64; u32 in v1), type (u32), offset (u64) |
//! | padding | to `general.alignment` (32 by default) |
//! | tensor data | each tensor at its offset from here |
//!
//! A string is its length then its UTF-8 bytes; an array is its element type (u32), its length,
//! then its elements. The caps below follow llama.cpp's (a crafted file cannot make the reader
//! allocate more than the file holds).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file::{TensorInfo, Value};
use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{Device, Shape};

use crate::error::{Ctx, Error, Result};
use crate::quant::iq4;

const MAX_STRING: u64 = 1 << 30;
const MAX_ELEMENTS: u64 = 1 << 30;
const MAX_DIMS: u32 = 4;
const MAX_DEPTH: usize = 64;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A tensor's type as the file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TensorType {
    /// A type candle reads.
    Ggml(GgmlDType),
    /// `IQ4_NL`: 32 values per block, an f16 scale and a 4-bit index each into a fixed table.
    Iq4Nl,
    /// `IQ4_XS`: 256 values per block, an f16 scale, a 6-bit scale per 32 and `IQ4_NL`'s indices.
    Iq4Xs,
}

impl TensorType {
    fn of(code: u32) -> std::result::Result<TensorType, String> {
        use GgmlDType as G;
        Ok(TensorType::Ggml(match code {
            0 => G::F32,
            1 => G::F16,
            2 => G::Q4_0,
            3 => G::Q4_1,
            6 => G::Q5_0,
            7 => G::Q5_1,
            8 => G::Q8_0,
            9 => G::Q8_1,
            10 => G::Q2K,
            11 => G::Q3K,
            12 => G::Q4K,
            13 => G::Q5K,
            14 => G::Q6K,
            15 => G::Q8K,
            30 => G::BF16,
            20 => return Ok(TensorType::Iq4Nl),
            23 => return Ok(TensorType::Iq4Xs),
            other => return Err(ggml_type_name(other)),
        }))
    }

    /// (values per block, bytes per block) of the types converted here.
    fn iq_block(self) -> Option<(usize, usize)> {
        match self {
            TensorType::Iq4Nl => Some((iq4::NL_VALUES, iq4::NL_BYTES)),
            TensorType::Iq4Xs => Some((iq4::XS_VALUES, iq4::XS_BYTES)),
            TensorType::Ggml(_) => None,
        }
    }
}

/// ggml's name of a type code ragkv does not read (for the error).
fn ggml_type_name(code: u32) -> String {
    let name = match code {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        _ => return format!("type {code}"),
    };
    format!("{name} (type {code})")
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub(crate) struct TensorEntry {
    pub ty: TensorType,
    /// Sizes, outermost first (candle's order: a matrix of `n` rows of `k` is `[n, k]`).
    pub dims: Vec<usize>,
    offset: u64,
}

/// A GGUF file's header: metadata, tensor table, and where the tensor data starts.
pub(crate) struct GgufFile {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorEntry>,
    data_offset: u64,
}

/// Reads little-endian fields, bounded by the file's size (the position counted here, not
/// asked of the file: a vocabulary is ~100k strings).
struct Fields<'a, R> {
    r: &'a mut R,
    pos: u64,
    size: u64,
    wide: bool,
}

impl<R: Read + Seek> Fields<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0; N];
        self.r.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A length or count: u64, or u32 in GGUF v1.
    fn len(&mut self) -> Result<u64> {
        if self.wide {
            self.u64()
        } else {
            self.u32().map(u64::from)
        }
    }

    fn remaining(&self) -> u64 {
        self.size.saturating_sub(self.pos)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        if n > MAX_STRING || n > self.remaining() {
            return Err(bad(format!("a string of {n} bytes")));
        }
        let mut v = vec![0; n as usize];
        self.r.read_exact(&mut v)?;
        self.pos += n;
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        if depth > MAX_DEPTH {
            return Err(bad(format!("values nested over {MAX_DEPTH} deep")));
        }
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(bad(format!("a boolean of value {b}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len()?;
                // Every element takes at least a byte: no more of them than bytes left.
                if n > MAX_ELEMENTS || n > self.remaining() {
                    return Err(bad(format!("an array of {n} elements")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(bad(format!("metadata value type {other}"))),
        })
    }
}

fn bad(why: String) -> Error {
    Error::Config {
        why: format!("not a readable GGUF file: {why}"),
    }
}

/// A GGUF file opened for reading: its header parsed, the reader for its tensors.
pub(crate) type Opened = (GgufFile, std::io::BufReader<fs_err::File>);

impl GgufFile {
    /// Opens `path` and parses its header; errors name the file.
    pub fn open(path: &std::path::Path) -> Result<Opened> {
        let mut r = std::io::BufReader::new(fs_err::File::open(path)?);
        let file = GgufFile::read(&mut r).map_err(|e| match e {
            Error::Config { why } => Error::Config {
                why: format!("{}: {why}", path.display()),
            },
            Error::Unsupported { what } => Error::Unsupported {
                what: format!("{what} in {}", path.display()),
            },
            other => other,
        })?;
        Ok((file, r))
    }

    /// Parses the header of the file `r` reads (from its start).
    pub fn read<R: Read + Seek>(r: &mut R) -> Result<GgufFile> {
        let size = r.seek(SeekFrom::End(0))?;
        r.seek(SeekFrom::Start(0))?;
        let mut f = Fields {
            r,
            pos: 0,
            size,
            wide: true,
        };
        let magic = f.bytes::<4>()?;
        if &magic != b"GGUF" {
            return Err(bad(format!("magic {magic:02x?}")));
        }
        f.wide = match f.u32()? {
            1 => false,
            2 | 3 => true,
            v => return Err(bad(format!("version {v}"))),
        };
        let (tensors_n, meta_n) = (f.len()?, f.len()?);
        if tensors_n > MAX_ELEMENTS || meta_n > MAX_ELEMENTS || tensors_n + meta_n > f.remaining() {
            return Err(bad(format!(
                "{tensors_n} tensors and {meta_n} metadata entries"
            )));
        }
        let mut metadata = HashMap::new();
        for _ in 0..meta_n {
            let key = f.string()?;
            let ty = f.u32()?;
            let value = f.value(ty, 0).map_err(|e| bad(format!("{key}: {e}")))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::new();
        for _ in 0..tensors_n {
            let name = f.string()?;
            let n = f.u32()?;
            if n > MAX_DIMS {
                return Err(bad(format!("tensor {name} has {n} dimensions")));
            }
            let mut dims = (0..n)
                .map(|_| f.len().map(|d| d as usize))
                .collect::<Result<Vec<_>>>()?;
            dims.reverse();
            let ty = TensorType::of(f.u32()?).map_err(|t| Error::Unsupported {
                what: format!("GGUF tensor type {t} of {name}"),
            })?;
            let offset = f.u64()?;
            tensors.insert(name, TensorEntry { ty, dims, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Value::U32(a)) if *a > 0 => u64::from(*a),
            Some(Value::U16(a)) if *a > 0 => u64::from(*a),
            Some(Value::U8(a)) if *a > 0 => u64::from(*a),
            Some(Value::I32(a)) if *a > 0 => *a as u64,
            _ => DEFAULT_ALIGNMENT,
        };
        let at = f.pos;
        Ok(GgufFile {
            metadata,
            tensors,
            data_offset: at.div_ceil(alignment) * alignment,
        })
    }

    /// The tensor `name` read from `r` onto `device`: as stored, or, for the `IQ4` types, as
    /// `Q8_0` blocks of the same values.
    pub fn tensor<R: Read + Seek>(
        &self,
        r: &mut R,
        name: &str,
        device: &Device,
    ) -> Result<QTensor> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| weight(name, "not in the GGUF file".into()))?;
        let Some((per_block, block_bytes)) = e.ty.iq_block() else {
            let TensorType::Ggml(ggml_dtype) = e.ty else {
                unreachable!("every other type is a candle one")
            };
            let info = TensorInfo {
                ggml_dtype,
                shape: Shape::from(e.dims.clone()),
                offset: e.offset,
            };
            return info
                .read(r, self.data_offset, device)
                .ctx(&format!("reading {name}"));
        };
        let raw = self.raw(r, name, e, per_block, block_bytes)?;
        let q8 = match e.ty {
            TensorType::Iq4Nl => iq4::nl_to_q8_0(&raw),
            _ => iq4::xs_to_q8_0(&raw),
        }
        .map_err(|why| weight(name, why))?;
        ggml_file::qtensor_from_ggml(GgmlDType::Q8_0, &q8, e.dims.clone(), device)
            .ctx(&format!("reading {name}"))
    }

    /// The tensor `name` as `IQ4_NL` blocks, row after row, when the file holds it in one of
    /// the `IQ4` types (`IQ4_XS` rewritten, [`iq4::xs_to_nl`]); `None` for any other type.
    pub fn iq4_nl_blocks<R: Read + Seek>(&self, r: &mut R, name: &str) -> Result<Option<Vec<u8>>> {
        let Some(e) = self.tensors.get(name) else {
            return Ok(None);
        };
        let Some((per_block, block_bytes)) = e.ty.iq_block() else {
            return Ok(None);
        };
        let raw = self.raw(r, name, e, per_block, block_bytes)?;
        match e.ty {
            TensorType::Iq4Xs => iq4::xs_to_nl(&raw).map(Some),
            _ => Ok(Some(raw)),
        }
        .map_err(|why| weight(name, why))
    }

    /// The tensor `name`'s own `IQ4_XS` blocks, row after row; `None` for any other type.
    pub fn iq4_xs_blocks<R: Read + Seek>(&self, r: &mut R, name: &str) -> Result<Option<Vec<u8>>> {
        match self.tensors.get(name) {
            Some(e) if e.ty == TensorType::Iq4Xs => self
                .raw(r, name, e, iq4::XS_VALUES, iq4::XS_BYTES)
                .map(Some),
            _ => Ok(None),
        }
    }

    /// The bytes of `e` (`name`), blocks of `per_block` values in `block_bytes`.
    fn raw<R: Read + Seek>(
        &self,
        r: &mut R,
        name: &str,
        e: &TensorEntry,
        per_block: usize,
        block_bytes: usize,
    ) -> Result<Vec<u8>> {
        let row = e.dims.last().copied().unwrap_or(0);
        if row == 0 || !row.is_multiple_of(per_block) {
            return Err(weight(
                name,
                format!("rows of {row} values in blocks of {per_block}"),
            ));
        }
        let elems: usize = e.dims.iter().product();
        let len = (elems / per_block * block_bytes) as u64;
        let start = self.data_offset.saturating_add(e.offset);
        let size = r.seek(SeekFrom::End(0))?;
        if start.saturating_add(len) > size {
            return Err(weight(
                name,
                format!("{len} bytes at {start} in a file of {size} bytes"),
            ));
        }
        let mut raw = vec![0; len as usize];
        r.seek(SeekFrom::Start(start))?;
        r.read_exact(&mut raw)?;
        Ok(raw)
    }
}

fn weight(name: &str, why: String) -> Error {
    Error::Weight {
        name: name.into(),
        why,
    }
}

#[cfg(test)]
mod tests;
