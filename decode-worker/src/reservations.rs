//! The reservation table: KV blocks a decode worker holds for a prompt whose KV a prefill
//! worker is sending. Model-free state (no model, no channels, no clock: every method that
//! depends on time takes `now`), driven by the scheduler and unit-tested here.
//!
//! Life of a reservation: [`Reservations::reserve`] allocates the fresh blocks after the
//! cached prefix and leases their regions to the KV receivers, which write arriving KV
//! straight into them (see [`crate::leases`]); arriving KV ([`Reservations::touch`],
//! [`Reservations::received`]) extends its lifetime; the
//! request's `Generate` claims it ([`Reservations::claim`]); once claimed and complete it
//! leaves the table as a running sequence ([`Reservations::take_ready`]). Otherwise it ends
//! in [`Reservations::expire`] or [`Reservations::drop`].
//!
//! Invariants:
//! - a reservation owns exactly the blocks of its cache sequence: every path out of the
//!   table either hands the sequence on (`take_ready`) or frees it, so
//!   every block is free or held by a live sequence (`free + held == total`) and no block
//!   outlives its reservation, except while a receiver still holds the ended reservation's
//!   lease: then its blocks stay parked until the lease is back ([`Reservations::reclaim`]);
//! - an unclaimed reservation lives at most `ttl` (capped by the worker's maximum) after
//!   its last piece of KV; a claimed one at most `kv_wait_timeout` after its claim;
//! - the shared lease map lists exactly the reservations in the table;
//! - a reservation's KV is committed and run only with its lease in hand.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use duet_engine::{reusable_tokens, AttentionPolicy, BlockHash, EngineError, KvCache, PrefixHit};

use crate::error::DecodeError;
use crate::handle::Reserved;
use crate::leases::{LeaseCell, Leases, Parked};

/// The claim of a reservation by its request's `Generate`.
pub(crate) struct Claim<C> {
    /// What runs once the KV is complete (the scheduler's sequence).
    pub seq: C,
    pub first_token: u32,
    pub at: Instant,
}

struct Reservation<C> {
    /// Its lease's generation (`crate::leases`): what receivers' reports must name.
    lease: u64,
    prompt_tokens: usize,
    /// Tokens of KV that arrive: the prompt's, or the slots SnapKV kept of it.
    arriving: usize,
    /// Leading prompt tokens attached from the prefix cache, and their block hashes (checked
    /// against the prompt when Generate claims the reservation).
    cached: usize,
    cached_hashes: Vec<BlockHash>,
    received: usize,
    /// Every piece of KV that arrives extends the lifetime by `ttl`, so a long prefill
    /// streaming its KV keeps its blocks.
    expires: Instant,
    ttl: Duration,
    failed: Option<String>,
    claim: Option<Claim<C>>,
}

/// Why a reservation left the table without running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Never claimed within its lifetime.
    Expired,
    /// Claimed, then its client went away.
    ClientGone,
    /// The transfer reported a failure.
    TransferFailed(String),
    /// Claimed, and the KV did not complete within `kv_wait_timeout`.
    TransferTimeout,
}

impl Ending {
    /// The error the claiming client hears (`None`: nobody is listening).
    pub(crate) fn error(&self, id: u64) -> Option<DecodeError> {
        match self {
            Ending::Expired | Ending::ClientGone => None,
            Ending::TransferFailed(reason) => Some(DecodeError::TransferFailed {
                request_id: id,
                reason: reason.clone(),
            }),
            Ending::TransferTimeout => Some(DecodeError::TransferTimeout(id)),
        }
    }
}

/// What `Generate` finds when it comes for its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimCheck {
    /// No reservation under this id.
    Missing,
    /// Already claimed, or reserved for a prompt of another length.
    Conflict,
    /// Its cached prefix belongs to another prompt.
    ForeignPrefix,
    Free,
}

/// A reservation whose KV is complete: its sequence now runs, holding the blocks.
pub(crate) struct Ready<C> {
    pub id: u64,
    pub claim: Claim<C>,
    pub prompt_tokens: usize,
    pub cached: usize,
}

pub(crate) struct Reservations<C> {
    table: HashMap<u64, Reservation<C>>,
    leases: Leases,
    parked: Parked,
    /// The last lease generation given out.
    generation: u64,
    max_ttl: Duration,
}

impl<C> Reservations<C> {
    pub(crate) fn new(leases: Leases, max_ttl: Duration) -> Self {
        Reservations {
            table: HashMap::new(),
            leases,
            parked: Parked::default(),
            generation: 0,
            max_ttl,
        }
    }

    /// Ended reservations whose blocks wait for a receiver to let their lease go.
    pub(crate) fn parked(&self) -> usize {
        self.parked.len()
    }

    /// Frees the parked reservations whose lease is back; returns how many still wait.
    pub(crate) fn reclaim(&mut self, cache: &mut KvCache) -> usize {
        self.parked.reclaim(cache)
    }

    pub(crate) fn contains(&self, id: u64) -> bool {
        self.table.contains_key(&id)
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Reserves room in `cache` for a prompt of `tokens` tokens after the cached prefix of
    /// `hashes` (`None`: the prefix cache is off); returns the reply and the prefix hit.
    /// Under a local window (`attention`) the room is for the blocks the prompt keeps, in
    /// the order they arrive, under SnapKV for the slots it kept; neither uses the prefix
    /// cache. On error nothing is held.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reserve(
        &mut self,
        cache: &mut KvCache,
        id: u64,
        tokens: usize,
        ttl: Duration,
        hashes: Option<&[BlockHash]>,
        attention: AttentionPolicy,
        now: Instant,
    ) -> Result<(Reserved, PrefixHit), DecodeError> {
        if self.contains(id) || cache.contains(id) {
            return Err(DecodeError::Duplicate(id));
        }
        cache.add_sequence(id)?;
        let bs = cache.block_size();
        // Under a window only the kept blocks arrive; under SnapKV the kept slots, whose
        // later tokens are rotated in the prompt's frame. Neither uses the prefix cache.
        let arriving = attention.snapkv().map_or(tokens, |s| s.kept(tokens));
        let prepared = match attention {
            AttentionPolicy::Full => Ok(()),
            AttentionPolicy::Window(_) => cache
                .set_attention(id, attention)
                .and_then(|_| cache.expect_windowed_prompt(id, tokens)),
            AttentionPolicy::SnapKv(_) => cache
                .set_attention(id, attention)
                .and_then(|_| cache.expect_compressed_prompt(id, tokens, arriving)),
        };
        if let Err(e) = prepared {
            cache.free_sequence(id);
            return Err(e.into());
        }
        let hit = match hashes {
            Some(h) if !h.is_empty() && attention == AttentionPolicy::Full => {
                match cache.attach_prefix(id, h, reusable_tokens(tokens, bs)) {
                    Ok(hit) => hit,
                    Err(e) => {
                        cache.free_sequence(id);
                        return Err(e.into());
                    }
                }
            }
            _ => PrefixHit::default(),
        };
        let cached = hit.blocks() * bs;
        // A local layer group allocates only the blocks the whole prompt keeps; what
        // arrives for the others is not kept.
        let leased = cache
            .expect_prompt(id, arriving)
            .and_then(|_| cache.prepare_append(id, arriving - cached))
            .and_then(|_| cache.sequence_blocks(id).map(|b| b[cached / bs..].to_vec()))
            .and_then(|b| cache.lease_regions(id, cached / bs, &b).map(|l| (b, l)));
        let (blocks, lease) = match leased {
            Ok(b) => b,
            Err(e) => {
                cache.free_sequence(id);
                return Err(e.into());
            }
        };
        self.generation += 1;
        let generation = self.generation;
        crate::leases::map(&self.leases)
            .insert(id, std::sync::Arc::new(LeaseCell::new(lease, generation)));
        let ttl = ttl.min(self.max_ttl);
        let cached_hashes = hashes.map_or_else(Vec::new, |h| h[..cached / bs].to_vec());
        self.table.insert(
            id,
            Reservation {
                lease: generation,
                prompt_tokens: tokens,
                arriving,
                cached,
                cached_hashes,
                received: cached,
                expires: now + ttl,
                ttl,
                failed: None,
                claim: None,
            },
        );
        Ok((
            Reserved {
                cached_tokens: cached,
                blocks,
            },
            hit,
        ))
    }

    /// Reservation `id`, if a receiver's report under lease generation `lease` (`None`: it
    /// held none) is about it and not about an earlier reservation of the same id.
    fn reported(&mut self, id: u64, lease: Option<u64>) -> Option<&mut Reservation<C>> {
        self.table
            .get_mut(&id)
            .filter(|r| lease.is_none_or(|g| g == r.lease))
    }

    /// A layer of KV arrived for reservation `id` (written into its blocks by a receiver
    /// under lease `lease`): its lifetime is extended.
    pub(crate) fn touch(&mut self, id: u64, lease: u64, now: Instant) {
        if let Some(r) = self.reported(id, Some(lease)) {
            r.expires = now + r.ttl;
        }
    }

    /// The KV of prompt tokens up to `token_end` has arrived (under lease `lease`).
    pub(crate) fn received(&mut self, id: u64, token_end: usize, lease: Option<u64>, now: Instant) {
        if let Some(r) = self.reported(id, lease) {
            r.received = r.received.max(token_end);
            r.expires = now + r.ttl;
        }
    }

    /// The transfer (under lease `lease`) failed; the reservation ends at the next
    /// [`Reservations::expire`].
    pub(crate) fn failed(&mut self, id: u64, reason: String, lease: Option<u64>) {
        if let Some(r) = self.reported(id, lease) {
            r.failed = Some(reason);
        }
    }

    /// Whether `Generate` for a prompt of `prompt_len` tokens may claim reservation `id`;
    /// `prefix_matches` says whether a prompt starts with the given cached block hashes.
    pub(crate) fn check_claim(
        &self,
        id: u64,
        prompt_len: usize,
        prefix_matches: impl FnOnce(&[BlockHash]) -> bool,
    ) -> ClaimCheck {
        match self.table.get(&id) {
            None => ClaimCheck::Missing,
            Some(r) if r.claim.is_some() || r.prompt_tokens != prompt_len => ClaimCheck::Conflict,
            Some(r) if !prefix_matches(&r.cached_hashes) => ClaimCheck::ForeignPrefix,
            Some(_) => ClaimCheck::Free,
        }
    }

    /// Claims reservation `id` for `seq`; gives `seq` back when there is nothing to claim.
    pub(crate) fn claim(&mut self, id: u64, claim: Claim<C>) -> Result<(), C> {
        match self.table.get_mut(&id) {
            Some(r) if r.claim.is_none() => {
                r.claim = Some(claim);
                Ok(())
            }
            _ => Err(claim.seq),
        }
    }

    /// Ends reservation `id`: its blocks go back to the pool; returns its claimant, if any.
    /// (If a receiver is still writing into them, they are parked until it stops.)
    pub(crate) fn drop(&mut self, cache: &mut KvCache, id: u64) -> Option<Option<C>> {
        let r = self.table.remove(&id)?;
        let cell = self.unlist(id);
        self.parked.end(cache, id, cell);
        Some(r.claim.map(|c| c.seq))
    }

    /// Ends every reservation that is past its lifetime, failed, waited too long for its KV,
    /// or whose claimant is `gone`; frees their blocks and returns them with why they ended.
    pub(crate) fn expire(
        &mut self,
        cache: &mut KvCache,
        now: Instant,
        kv_wait_timeout: Duration,
        gone: impl Fn(&C) -> bool,
    ) -> Vec<(u64, Option<C>, Ending)> {
        let ending: Vec<(u64, Ending)> = self
            .table
            .iter()
            .filter_map(|(&id, r)| {
                let e = match (&r.claim, &r.failed) {
                    (None, _) if now >= r.expires => Ending::Expired,
                    (None, _) => return None,
                    (Some(c), _) if gone(&c.seq) => Ending::ClientGone,
                    (Some(_), Some(reason)) => Ending::TransferFailed(reason.clone()),
                    (Some(c), None) if now.duration_since(c.at) >= kv_wait_timeout => {
                        Ending::TransferTimeout
                    }
                    (Some(_), None) => return None,
                };
                Some((id, e))
            })
            .collect();
        ending
            .into_iter()
            .filter_map(|(id, e)| self.drop(cache, id).map(|seq| (id, seq, e)))
            .collect()
    }

    /// Takes every claimed reservation whose KV is complete out of the table; its sequence
    /// in `cache` now holds the whole prompt. A sequence whose KV cannot be committed is
    /// freed and returned as an error with its claimant.
    pub(crate) fn take_ready(
        &mut self,
        cache: &mut KvCache,
    ) -> Vec<Result<Ready<C>, (C, EngineError)>> {
        let ready: Vec<u64> = self
            .table
            .iter()
            .filter(|(_, r)| r.claim.is_some() && r.failed.is_none() && r.received >= r.arriving)
            .map(|(&id, _)| id)
            .collect();
        let mut out = Vec::with_capacity(ready.len());
        for id in ready {
            // Only with the lease in hand: a receiver still holding it (a second transfer for
            // a complete reservation) may be writing; wait for it to let go.
            let lease = self.cell(id).map(|c| c.take());
            if matches!(lease, Some(None)) {
                continue;
            }
            let Some(r) = self.table.remove(&id) else {
                continue;
            };
            self.unlist(id);
            let Some(claim) = r.claim else {
                cache.free_sequence(id);
                continue;
            };
            match cache.commit_append(id, r.arriving - r.cached) {
                Ok(()) => out.push(Ok(Ready {
                    id,
                    claim,
                    prompt_tokens: r.prompt_tokens,
                    cached: r.cached,
                })),
                Err(e) => {
                    cache.free_sequence(id);
                    out.push(Err((claim.seq, e)));
                }
            }
        }
        out
    }

    /// Ends every reservation (shutdown); returns the claimants.
    pub(crate) fn drain(&mut self, cache: &mut KvCache) -> Vec<(u64, C)> {
        let ids: Vec<u64> = self.table.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| match self.drop(cache, id) {
                Some(Some(seq)) => Some((id, seq)),
                _ => None,
            })
            .collect()
    }

    fn cell(&self, id: u64) -> Option<std::sync::Arc<LeaseCell>> {
        crate::leases::map(&self.leases).get(&id).cloned()
    }

    /// Takes `id` out of the shared map; returns its cell.
    fn unlist(&self, id: u64) -> Option<std::sync::Arc<LeaseCell>> {
        crate::leases::map(&self.leases).remove(&id)
    }
}

#[cfg(test)]
#[path = "reservations_tests.rs"]
mod tests;
