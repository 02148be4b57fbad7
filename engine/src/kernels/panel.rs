//! The layout both panel kernels share ([`super::kpanel`] for the K-quants,
//! [`super::q0panel`] for the 32-value formats): weight rows in panels of [`PANEL`], four
//! consecutive codes of a row to one 32-bit lane, so that one AVX-512 VNNI `vpdpbusd`
//! multiplies four values of 16 rows at once. Within a (panel, block), the code of panel row
//! `j`, value `4g+k` is at byte `64g + 4j + k`.

/// Weight rows per panel: the 16 i32 lanes of an AVX-512 register.
pub const PANEL: usize = 16;

/// Whether this CPU runs the panel kernels (AVX-512 F/BW/DQ and VNNI).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::avx512_kpanel::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Blocks per weight row when `rows` rows of `row_bytes` (whole blocks of `block_bytes`)
/// are exactly `data_len` bytes and make whole panels; `None` otherwise.
pub fn blocks_per_row(
    rows: usize,
    row_bytes: usize,
    block_bytes: usize,
    data_len: usize,
) -> Option<usize> {
    let fits = rows > 0
        && rows.is_multiple_of(PANEL)
        && row_bytes.is_multiple_of(block_bytes)
        && data_len == rows * row_bytes;
    fits.then(|| row_bytes / block_bytes)
}

/// Writes one block's codes `q` (element order) of panel row `j` into that (panel, block)'s
/// interleaved codes `dst` (`q.len() * PANEL` bytes).
pub fn interleave(dst: &mut [u8], j: usize, q: &[u8]) {
    for (g, four) in q.chunks_exact(4).enumerate() {
        let at = g * 4 * PANEL + 4 * j;
        dst[at..at + 4].copy_from_slice(four);
    }
}

/// Deterministic bytes for the kernels' tests: any bytes are valid codes and scales (the
/// tests then set each block's f16 scales to small normal values).
#[cfg(test)]
pub fn test_bytes(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) >> 11) as u8)
        .collect()
}

/// Deterministic activations in [-1, 1] for the kernels' tests.
#[cfg(test)]
pub fn test_values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32).wrapping_mul(747_796_405).wrapping_add(seed) >> 9;
            (h % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Value `4g+k` of panel row `j` lands at `64g + 4j + k`, and only there.
    #[test]
    fn codes_interleave_four_to_a_lane() {
        let q: Vec<u8> = (0..32).collect();
        let mut dst = vec![0xffu8; 32 * PANEL];
        interleave(&mut dst, 3, &q);
        for (i, &b) in dst.iter().enumerate() {
            let (g, lane, k) = (i / 64, i % 64 / 4, i % 4);
            let want = if lane == 3 { (4 * g + k) as u8 } else { 0xff };
            assert_eq!(b, want, "byte {i}");
        }
        assert_eq!(blocks_per_row(32, 40, 20, 32 * 40), Some(2));
        assert_eq!(blocks_per_row(8, 40, 20, 8 * 40), None, "not whole panels");
        assert_eq!(
            blocks_per_row(16, 41, 20, 16 * 41),
            None,
            "not whole blocks"
        );
        assert_eq!(blocks_per_row(16, 40, 20, 16 * 40 - 1), None, "short data");
    }
}
