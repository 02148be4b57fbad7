//! What the prefill engine sends outside its forward's layer hook: a cached prefix's
//! blocks, and a windowed or compressed prompt's kept blocks once it is computed, each as
//! one transfer of every layer.

use duet_engine::AttentionPolicy;
use duet_kv_transfer::TransferDesc;

use super::{Engine, Running};
use crate::error::PrefillError;
use crate::send_pool::sequence_regions;
use crate::transfer::Msg;

/// Which blocks a transfer sends.
pub(super) enum Source<'a> {
    /// These blocks (a windowed or compressed prompt's kept ones, one table).
    Held(&'a [u32]),
    /// The request's logical blocks in this range, each layer's from its group's table
    /// (a block a local group dropped goes as zeros; the receiver does not keep it).
    Logical(std::ops::Range<usize>),
}

impl Engine {
    /// Sends the KV of tokens `from..to` (whole blocks, already in the cache) to `r`'s
    /// decode worker as one transfer of every layer.
    pub(super) fn send_cached(&self, r: &Running, from: usize, to: usize) {
        let bs = self.cache.block_size();
        let (first, last) = (from / bs, to / bs);
        let dst0 = r.job.dst_start / bs;
        let dst = &r.job.dst_blocks[first - dst0..last - dst0];
        self.send_blocks(r, Source::Logical(first..last), from..to, dst);
    }

    /// Sends a windowed prompt's kept blocks ([`duet_engine::Window::kept_blocks`]), once it
    /// is computed and its dropped blocks are gone: its sink blocks, then the blocks of the
    /// next query's window, each run as one transfer into the destinations listed in that
    /// order; or a SnapKV prompt's compacted slots. Returns false when the sequence does not
    /// hold exactly the blocks [`Self::job_blocks`] says it sends.
    pub(super) fn send_kept(&self, r: &Running) -> bool {
        let (bs, len) = (self.cache.block_size(), r.job.prompt.len());
        let Ok(blocks) = self.cache.sequence_blocks(r.job.request_id) else {
            return false;
        };
        let sent = self.job_blocks(len, r.job.attention).sent;
        if blocks.len() != sent || blocks.len() != r.job.dst_blocks.len() {
            return false;
        }
        let runs = match r.job.attention {
            // The compacted slots, in slot order, as one transfer.
            AttentionPolicy::SnapKv(p) => {
                self.send_blocks(r, Source::Held(blocks), 0..p.kept(len), &r.job.dst_blocks);
                return true;
            }
            AttentionPolicy::Window(w) => w.kept_blocks(len, bs),
            AttentionPolicy::Full => return false,
        };
        let mut at = 0;
        for run in runs.into_iter().filter(|x| !x.is_empty()) {
            let n = run.len();
            let tokens = run.start * bs..(run.end * bs).min(len);
            self.send_blocks(
                r,
                Source::Held(&blocks[at..at + n]),
                tokens,
                &r.job.dst_blocks[at..at + n],
            );
            at += n;
        }
        true
    }

    /// One transfer of every layer of `blocks` (holding `tokens`) into `dst`.
    fn send_blocks(
        &self,
        r: &Running,
        blocks: Source<'_>,
        tokens: std::ops::Range<usize>,
        dst: &[u32],
    ) {
        let desc = TransferDesc {
            request_id: r.job.request_id,
            token_start: tokens.start as u32,
            token_count: tokens.len() as u32,
            dst_blocks: dst.to_vec(),
        };
        let _ = r.tx.send(Msg::Begin(desc));
        for layer in 0..self.cache.layout().n_layers {
            let regions = match &blocks {
                Source::Held(b) => Some(self.cache.pinned_regions(layer, b)),
                Source::Logical(range) => {
                    sequence_regions(&self.cache, r.job.request_id, range.clone(), layer)
                }
            };
            let Some((k, v)) = regions else {
                let _ = r.tx.send(Msg::Fail(PrefillError::StepFailed(
                    "the cached prefix to send is not in the cache".into(),
                )));
                return;
            };
            let _ = r.tx.send(Msg::Layer {
                layer: layer as u32,
                k,
                v,
            });
        }
        let _ = r.tx.send(Msg::Finish);
    }
}
