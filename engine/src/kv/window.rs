//! Local attention with attention sinks (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453)
//! as a KV-memory policy of the paged cache.
//!
//! A windowed sequence's token at position `p` attends to the first `sinks` tokens and to
//! its own last `window` tokens (itself included): key `t` is visible when `t < sinks` or
//! `p - t < window`. The mask is per token, so a row's result does not depend on block
//! boundaries or on how its prompt was cut into chunks.
//!
//! Positions are those *within the cache*, as the paper assigns them: once tokens between
//! the sinks and the window have been dropped, the query sits at cache position
//! `sinks + window - 1` and the sinks at `0..sinks`. RoPE scores depend only on the
//! distance between a query and a key, so the engine keeps every key rotated at its own
//! position and rotates the query twice: at its position for the window (distances within
//! the window are the same in both frames) and at [`Window::sink_query_pos`] for the sinks.
//! A sequence that drops nothing (at most `sinks + window` tokens) is computed exactly as
//! under full attention.
//!
//! Memory: after each commit the cache returns every block whose tokens no later query can
//! see (no sink token in it and all of it before the next query's window), so a sequence
//! holds at most `ceil(sinks / bs) + ceil(window / bs) + 1` blocks between forwards, plus
//! the rows of the chunk being computed. Generation may therefore run past the model's
//! context length: no query ever sees a distance larger than `sinks + window - 1`.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::allocator::BlockId;
use super::cache::{KvCache, SeqId, DROPPED};
use super::snapkv::SnapKv;
use crate::error::{EngineError, Result};

/// The most tokens a windowed sequence may hold (prompt and generated): nothing the model
/// imposes, since no query sees further back than its sinks and window.
pub const WINDOWED_MAX_TOKENS: usize = u32::MAX as usize;

/// Which keys a sequence's queries attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionPolicy {
    /// Every earlier token (the model's own attention).
    #[default]
    Full,
    /// The first `sinks` tokens and the last `window` (StreamingLLM).
    Window(Window),
    /// Full attention over the prompt positions SnapKV keeps once the prompt is computed
    /// (`super::snapkv`).
    SnapKv(SnapKv),
}

/// The sizes of a local window with sinks, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Tokens each query sees back from itself, itself included (at least 1).
    pub window: usize,
    /// Leading tokens every query sees.
    pub sinks: usize,
}

impl Window {
    /// Whether the query at position `p` sees the key at position `t <= p`.
    pub fn sees(&self, p: usize, t: usize) -> bool {
        t < self.sinks || p - t < self.window
    }

    /// Whether the query at `p` is masked at all (some earlier key is out of its view).
    pub fn masks(&self, p: usize) -> bool {
        p >= self.sinks + self.window
    }

    /// The position the query at `p` takes when it scores the sinks: its position within
    /// the cache (`p` while nothing is masked).
    pub fn sink_query_pos(&self, p: usize) -> usize {
        p.min(self.sinks + self.window - 1)
    }

    /// The first position the query at `p` sees after the sinks.
    pub fn window_start(&self, p: usize) -> usize {
        (p + 1).saturating_sub(self.window).max(self.sinks)
    }

    /// Logical blocks holding a sink token (never dropped).
    pub fn sink_blocks(&self, block_size: usize) -> usize {
        self.sinks.div_ceil(block_size)
    }

    /// Logical blocks `0..n` that no query at `len` or later can see, sinks aside: every
    /// block before the one holding the next query's first window position.
    pub fn droppable_below(&self, len: usize, block_size: usize) -> usize {
        self.window_start(len) / block_size
    }

    /// The most blocks a sequence holds between forwards.
    pub fn max_blocks(&self, block_size: usize) -> usize {
        self.sink_blocks(block_size) + self.window.div_ceil(block_size) + 1
    }

    /// The most blocks a sequence of `tokens` tokens holds while it is computed in chunks of
    /// at most `chunk` tokens: what admission reserves room for.
    pub fn peak_blocks(&self, tokens: usize, chunk: usize, block_size: usize) -> usize {
        let bound = self.max_blocks(block_size) + chunk.div_ceil(block_size) + 1;
        tokens.div_ceil(block_size).min(bound)
    }

    /// The logical blocks a sequence of `len` tokens keeps after its last commit: its sink
    /// blocks, then every block from the one holding the next query's first window
    /// position (the second range starts where the first ends when nothing was dropped).
    /// Only these travel when its KV moves to another worker.
    pub fn kept_blocks(&self, len: usize, block_size: usize) -> [Range<usize>; 2] {
        let n = len.div_ceil(block_size);
        let sinks = self.sink_blocks(block_size).min(n);
        let tail = self.droppable_below(len, block_size).clamp(sinks, n);
        [0..sinks, tail..n]
    }
}

impl AttentionPolicy {
    /// The window, if any.
    pub fn window(&self) -> Option<Window> {
        match self {
            AttentionPolicy::Window(w) => Some(*w),
            AttentionPolicy::Full | AttentionPolicy::SnapKv(_) => None,
        }
    }

    /// The SnapKV selection, if any.
    pub fn snapkv(&self) -> Option<SnapKv> {
        match self {
            AttentionPolicy::SnapKv(s) => Some(*s),
            AttentionPolicy::Full | AttentionPolicy::Window(_) => None,
        }
    }

    /// The most tokens a sequence under this policy may hold in a model of
    /// `context_length`.
    pub fn max_sequence_tokens(&self, context_length: usize) -> usize {
        match self {
            AttentionPolicy::Full | AttentionPolicy::SnapKv(_) => context_length,
            AttentionPolicy::Window(_) => WINDOWED_MAX_TOKENS,
        }
    }

    /// A policy this model can run: a window of at least one token, and sinks plus window
    /// within the model's context (the largest distance a query may see).
    pub fn validate(&self, context_length: usize) -> Result<()> {
        if let Some(s) = self.snapkv() {
            s.validate()?;
            if s.budget >= context_length {
                return Err(EngineError::invalid(
                    "attention.snapkv",
                    format!(
                        "budget {} is not below the context {context_length}",
                        s.budget
                    ),
                ));
            }
        }
        let Some(w) = self.window() else {
            return Ok(());
        };
        if w.window == 0 {
            return Err(EngineError::invalid(
                "attention.window",
                "must be at least 1",
            ));
        }
        if w.window + w.sinks > context_length {
            return Err(EngineError::invalid(
                "attention.window",
                format!(
                    "window {} + sinks {} exceed the model's context {context_length}",
                    w.window, w.sinks
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for AttentionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionPolicy::Full => write!(f, "full"),
            AttentionPolicy::Window(w) => write!(f, "window={},sinks={}", w.window, w.sinks),
            AttentionPolicy::SnapKv(s) => s.fmt(f),
        }
    }
}

/// `full`, `window=W[,sinks=S]` (sinks default to 4, the paper's choice), or
/// `snapkv=B[,observe=O][,pool=P]` (SnapKV's budget; observe 32 and pool 7 by default, the
/// paper's).
impl FromStr for AttentionPolicy {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if s == "full" {
            return Ok(AttentionPolicy::Full);
        }
        if s.starts_with("snapkv") {
            return parse_snapkv(s);
        }
        let (mut window, mut sinks) = (None, 4);
        for (k, n) in settings(s, "full, or window=W,sinks=S")? {
            match k {
                "window" => window = Some(n),
                "sinks" => sinks = n,
                other => {
                    return Err(format!(
                        "unknown attention setting `{other}` (window, sinks)"
                    ))
                }
            }
        }
        let window = window.ok_or("`window=W` is required (or `full`)")?;
        if window == 0 {
            return Err("window must be at least 1 token".into());
        }
        Ok(AttentionPolicy::Window(Window { window, sinks }))
    }
}

/// The `key=N` settings of a policy written `form`, in order.
fn settings<'s>(s: &'s str, form: &str) -> std::result::Result<Vec<(&'s str, usize)>, String> {
    s.split(',')
        .map(|part| {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected key=value ({form})"))?;
            let n = v
                .trim()
                .parse()
                .map_err(|_| format!("`{k}`: `{v}` is not a whole number"))?;
            Ok((k.trim(), n))
        })
        .collect()
}

fn parse_snapkv(s: &str) -> std::result::Result<AttentionPolicy, String> {
    let mut p = SnapKv {
        budget: 0,
        observe: SnapKv::DEFAULT_OBSERVE,
        pool: SnapKv::DEFAULT_POOL,
    };
    for (k, n) in settings(s, "snapkv=B,observe=O,pool=P")? {
        match k {
            "snapkv" => p.budget = n,
            "observe" => p.observe = n,
            "pool" => p.pool = n,
            other => {
                return Err(format!(
                    "unknown SnapKV setting `{other}` (snapkv, observe, pool)"
                ))
            }
        }
    }
    p.validate().map_err(|e| e.to_string())?;
    Ok(AttentionPolicy::SnapKv(p))
}

impl KvCache {
    /// The block of every position's block index, `DROPPED` where a windowed sequence
    /// dropped one: what a forward indexes by `pos / block_size`.
    pub fn logical_table(&self, id: SeqId) -> Result<Vec<BlockId>> {
        let s = self.seq(id)?;
        if s.dropped == 0 {
            return Ok(s.blocks.clone());
        }
        let sinks = s
            .window
            .map_or(0, |w| w.sink_blocks(self.layout.block_size));
        let mut t = Vec::with_capacity(s.blocks.len() + s.dropped);
        t.extend_from_slice(&s.blocks[..sinks]);
        t.extend(std::iter::repeat_n(DROPPED, s.dropped));
        t.extend_from_slice(&s.blocks[sinks..]);
        Ok(t)
    }

    /// Gives the new, empty sequence `id` an attention policy (before any token).
    pub fn set_attention(&mut self, id: SeqId, policy: AttentionPolicy) -> Result<()> {
        self.empty_seq_mut(id, "attention")?.window = policy.window();
        Ok(())
    }

    /// Prepares the new, empty windowed sequence `id` for a prompt of `tokens` tokens whose
    /// KV arrives from elsewhere: only the kept blocks ([`Window::kept_blocks`]) travel, so
    /// the blocks such a prompt drops are marked dropped before any block is allocated;
    /// [`KvCache::prepare_append`] then allocates just the kept ones, in transfer order.
    pub fn expect_windowed_prompt(&mut self, id: SeqId, tokens: usize) -> Result<()> {
        let bs = self.layout.block_size;
        let s = self.empty_seq_mut(id, "sequence")?;
        let Some(w) = s.window else {
            return Err(EngineError::invalid(
                "attention",
                format!("sequence {id} has no window"),
            ));
        };
        let [sinks, tail] = w.kept_blocks(tokens, bs);
        s.dropped = tail.start - sinks.end;
        Ok(())
    }

    /// The sequence's local window (`None`: full attention).
    pub fn window(&self, id: SeqId) -> Result<Option<Window>> {
        Ok(self.seq(id)?.window)
    }

    /// Returns the blocks of windowed sequence `id` that no later query can see.
    pub(super) fn drop_out_of_window(&mut self, id: SeqId) {
        let bs = self.layout.block_size;
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let Some(w) = s.window else {
            return;
        };
        let sinks = w.sink_blocks(bs);
        let below = w.droppable_below(s.len, bs);
        let n = below.saturating_sub(sinks + s.dropped);
        if n == 0 {
            return;
        }
        let gone: Vec<BlockId> = s.blocks.drain(sinks..sinks + n).collect();
        s.dropped += n;
        for b in gone {
            self.release_block(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(window: usize, sinks: usize) -> Window {
        Window { window, sinks }
    }

    #[test]
    fn the_mask_keeps_sinks_and_the_last_window_tokens() {
        let x = w(3, 2);
        let seen: Vec<usize> = (0..=9).filter(|&t| x.sees(9, t)).collect();
        assert_eq!(seen, vec![0, 1, 7, 8, 9]);
        assert!(!x.masks(4), "5 tokens fit in sinks + window");
        assert!(x.masks(5));
        assert_eq!(x.sink_query_pos(3), 3);
        assert_eq!(
            x.sink_query_pos(100),
            4,
            "cache position sinks + window - 1"
        );
        assert_eq!(x.window_start(9), 7);
        assert_eq!(x.window_start(2), 2);
    }

    #[test]
    fn droppable_blocks_are_those_no_later_query_sees() {
        // Blocks of 4; sinks in block 0; a window of 6.
        let x = w(6, 2);
        // The next query at 20 sees 15..=20: blocks below 3 (tokens 0..12) are out of view.
        assert_eq!(x.droppable_below(20, 4), 3);
        assert_eq!(x.droppable_below(5, 4), 0);
        assert_eq!(x.sink_blocks(4), 1);
        assert_eq!(x.max_blocks(4), 1 + 2 + 1);
    }

    #[test]
    fn a_prompt_keeps_its_sink_blocks_and_the_blocks_of_the_next_window() {
        // Blocks of 4, 2 sinks (block 0), window 6: after 20 tokens the next query (20) sees
        // 15..=20, so blocks 3 and 4 (tokens 12..20) stay with block 0.
        assert_eq!(w(6, 2).kept_blocks(20, 4), [0..1, 3..5]);
        // Nothing dropped yet: one run of blocks.
        assert_eq!(w(6, 2).kept_blocks(7, 4), [0..1, 1..2]);
        // Fewer tokens than sinks.
        assert_eq!(w(6, 9).kept_blocks(5, 4), [0..2, 2..2]);
        assert_eq!(w(6, 0).kept_blocks(20, 4), [0..0, 3..5]);
        // Admission: bounded by the window whatever the prompt, never above the prompt.
        assert_eq!(w(6, 2).peak_blocks(10_000, 8, 4), 1 + 2 + 1 + 2 + 1);
        assert_eq!(w(6, 2).peak_blocks(5, 8, 4), 2);
    }

    #[test]
    fn policies_parse_print_and_validate() {
        let p: AttentionPolicy = "window=512,sinks=4".parse().unwrap();
        assert_eq!(p, AttentionPolicy::Window(w(512, 4)));
        assert_eq!(p.to_string(), "window=512,sinks=4");
        assert_eq!(
            "window=64".parse::<AttentionPolicy>().unwrap(),
            AttentionPolicy::Window(w(64, 4))
        );
        assert_eq!(
            "full".parse::<AttentionPolicy>().unwrap(),
            AttentionPolicy::Full
        );
        for bad in ["window=0", "sinks=4", "window=x", "width=3", "window"] {
            assert!(bad.parse::<AttentionPolicy>().is_err(), "{bad}");
        }
        let e = AttentionPolicy::Window(w(8000, 400))
            .validate(8192)
            .unwrap_err();
        assert!(e.to_string().contains("attention.window"), "{e}");
        assert!(AttentionPolicy::Window(w(8188, 4)).validate(8192).is_ok());
        let p: AttentionPolicy = "snapkv=1024".parse().unwrap();
        assert_eq!(p.to_string(), "snapkv=1024,observe=32,pool=7");
        assert_eq!(p.to_string().parse::<AttentionPolicy>().unwrap(), p);
        assert!(p.validate(8192).is_ok() && p.validate(1024).is_err());
        for bad in ["snapkv=16", "snapkv=64,pool=4", "snapkv=64,sinks=2"] {
            assert!(bad.parse::<AttentionPolicy>().is_err(), "{bad}");
        }
    }
}
