//! A bounds-checked walk over a GGUF header before candle parses it.
//!
//! candle's GGUF reader trusts the lengths it reads and allocates them up
//! front, so a corrupt or truncated file can make it request exabytes and
//! abort the process. This walk checks every count and length against the
//! bytes that remain in the file, so that candle only ever sees a header
//! whose allocations are bounded by the file size. It also refuses a tensor
//! type candle cannot read, naming the tensor and the type (candle's own
//! message names neither).

use crate::error::{EngineError, Result};

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const MAX_ARRAY_NESTING: u32 = 4;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file_len: u64,
}

fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::Format(msg.into())
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(corrupt(format!(
                "truncated while reading {what}: needs {n} bytes at offset {}, file has {}",
                self.pos, self.file_len
            )));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, what: &str) -> Result<&'a str> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| corrupt(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<()> {
        match ty {
            0 | 1 | 7 => {
                self.take(1, "scalar value")?;
            }
            2 | 3 => {
                self.take(2, "scalar value")?;
            }
            4..=6 => {
                self.take(4, "scalar value")?;
            }
            10..=12 => {
                self.take(8, "scalar value")?;
            }
            8 => {
                self.string("string value")?;
            }
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(corrupt("arrays nested too deeply"));
                }
                let elem_ty = self.u32("array element type")?;
                let n = self.u64("array length")?;
                // Every element takes at least one byte: a count beyond the
                // remaining bytes is corrupt, whatever the element type.
                if n > (self.buf.len() - self.pos) as u64 {
                    return Err(corrupt(format!("array of {n} elements exceeds the file")));
                }
                for _ in 0..n {
                    self.value(elem_ty, depth + 1)?;
                }
            }
            other => return Err(corrupt(format!("unknown metadata value type {other}"))),
        }
        Ok(())
    }
}

/// Validate the header of a GGUF file held in `buf` (the whole file, or at
/// least its header; `file_len` is the full length on disk).
pub fn check_header(buf: &[u8], file_len: u64) -> Result<()> {
    let mut c = Cursor {
        buf,
        pos: 0,
        file_len,
    };
    let magic = c.u32("magic")?;
    if magic != MAGIC {
        return Err(corrupt(format!(
            "bad magic {magic:#010x} (expected \"GGUF\")"
        )));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(corrupt(format!("unsupported GGUF version {version}")));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    let remaining = (buf.len() - c.pos) as u64;
    if n_tensors > remaining || n_kv > remaining {
        return Err(corrupt(format!(
            "header claims {n_tensors} tensors and {n_kv} metadata entries, more than the file holds"
        )));
    }
    for _ in 0..n_kv {
        c.string("metadata key")?;
        let ty = c.u32("metadata type")?;
        c.value(ty, 0)?;
    }
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32("tensor rank")?;
        if n_dims > 4 {
            return Err(corrupt(format!("tensor of rank {n_dims}")));
        }
        let mut elems: u64 = 1;
        for _ in 0..n_dims {
            let d = c.u64("tensor dim")?;
            elems = elems
                .checked_mul(d)
                .ok_or_else(|| corrupt("tensor dims overflow"))?;
        }
        if elems > file_len.saturating_mul(8) {
            return Err(corrupt(format!(
                "tensor of {elems} elements exceeds the file"
            )));
        }
        let ty = c.u32("tensor type")?;
        if !READABLE_TYPES.contains(&ty) {
            let kind = GGML_TYPE_NAMES
                .iter()
                .find(|(id, _)| *id == ty)
                .map_or("an unknown type", |(_, n)| n);
            return Err(EngineError::Unsupported(format!(
                "tensor `{name}` of ggml type {ty} ({kind}): duet reads F32, F16, BF16, \
                 Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and Q2_K to Q8_K"
            )));
        }
        c.u64("tensor offset")?;
    }
    Ok(())
}

/// The ggml tensor types candle reads (`GgmlDType::from_u32`).
const READABLE_TYPES: [u32; 15] = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30];

/// ggml's names of the types it does not read (`enum ggml_type`).
const GGML_TYPE_NAMES: [(u32, &str); 17] = [
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_magic_and_huge_lengths() {
        assert!(check_header(b"NOPE", 4).is_err());
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&u64::MAX.to_le_bytes()); // key length
        let err = check_header(&b, b.len() as u64).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }

    #[test]
    fn a_tensor_type_candle_cannot_read_is_refused_by_name() {
        let header = |ty: u32| {
            let mut b = Vec::new();
            b.extend_from_slice(&MAGIC.to_le_bytes());
            b.extend_from_slice(&3u32.to_le_bytes());
            b.extend_from_slice(&1u64.to_le_bytes()); // one tensor
            b.extend_from_slice(&0u64.to_le_bytes()); // no metadata
            let name = b"blk.0.attn_q.weight";
            b.extend_from_slice(&(name.len() as u64).to_le_bytes());
            b.extend_from_slice(name);
            b.extend_from_slice(&1u32.to_le_bytes()); // rank 1
            b.extend_from_slice(&256u64.to_le_bytes());
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&0u64.to_le_bytes()); // offset
            b
        };
        let b = header(23);
        let err = check_header(&b, b.len() as u64).unwrap_err();
        assert!(matches!(err, EngineError::Unsupported(_)), "{err}");
        let err = err.to_string();
        assert!(
            err.contains("blk.0.attn_q.weight") && err.contains("IQ4_XS"),
            "{err}"
        );
        let b = header(12); // Q4_K
        assert!(check_header(&b, b.len() as u64).is_ok());
    }
}
