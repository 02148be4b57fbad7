//! The leases of reserved blocks that KV receivers write into: shared between the engine
//! thread (which makes and ends them with the reservations) and the receivers (which take a
//! reservation's lease for the span of a transfer and write arriving regions straight into
//! the pool with it).
//!
//! Invariants:
//! - the shared map lists exactly the reservations in the table, each with its blocks;
//! - a lease is held by at most one receiver (taken out of its cell, put back when the
//!   transfer ends or the receiver is dropped), so no two connections write one block;
//! - the engine frees or runs a reservation's blocks only with the lease in hand (it takes
//!   the lease out of the cell itself, so a receiver that looked the cell up a moment before
//!   finds it empty): a reservation that ends while a receiver writes is parked under a
//!   fresh sequence id ([`Parked`]) and freed once the receiver has let the lease go, which
//!   it does within its link's timeout. A block is therefore never written by a receiver
//!   while it is free or part of a running sequence;
//! - each lease has a generation, unique in the worker: what a receiver reports (a layer
//!   arrived, the transfer ended or failed) names it, and a report for an earlier
//!   reservation of the same request id (a retry's) is ignored.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use duet_engine::{KvCache, RegionLease, SeqId};

/// One reservation's lease and the blocks it covers.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    generation: u64,
    blocks: HashSet<u32>,
    lease: Mutex<Option<RegionLease>>,
}

impl LeaseCell {
    pub(crate) fn new(lease: RegionLease, generation: u64) -> LeaseCell {
        LeaseCell {
            generation,
            blocks: lease.blocks().iter().copied().collect(),
            lease: Mutex::new(Some(lease)),
        }
    }

    #[cfg(test)]
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// How many blocks the lease covers.
    #[cfg(test)]
    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }

    fn slot(&self) -> MutexGuard<'_, Option<RegionLease>> {
        // A poisoned slot still holds a lease or not; its state is all that matters.
        self.lease.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the lease (`None`: a receiver holds it).
    pub(crate) fn take(&self) -> Option<RegionLease> {
        self.slot().take()
    }

    fn put_back(&self, lease: RegionLease) {
        *self.slot() = Some(lease);
    }
}

/// Leases by request id (see the module docs).
pub(crate) type Leases = Arc<Mutex<HashMap<u64, Arc<LeaseCell>>>>;

/// The map, whatever a panic elsewhere left it (it is consistent after every statement).
pub(crate) fn map(leases: &Leases) -> MutexGuard<'_, HashMap<u64, Arc<LeaseCell>>> {
    leases.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `block` is reserved for `request_id`.
pub(crate) fn is_reserved(leases: &Leases, request_id: u64, block: u32) -> bool {
    map(leases)
        .get(&request_id)
        .is_some_and(|c| c.blocks.contains(&block))
}

/// Whether a report about `request_id`'s transfer under lease `generation` (`None`: the
/// transfer never held one) is about its current reservation, if it has one.
pub(crate) fn is_current(leases: &Leases, request_id: u64, generation: Option<u64>) -> bool {
    match (map(leases).get(&request_id), generation) {
        (Some(c), Some(g)) => c.generation == g,
        _ => true,
    }
}

/// A receiver's hold on a reservation's lease; puts it back when dropped.
#[derive(Debug)]
pub(crate) struct Held {
    cell: Arc<LeaseCell>,
    lease: Option<RegionLease>,
}

impl Held {
    /// Takes `request_id`'s lease; `None` when there is no such reservation or another
    /// receiver holds it.
    pub(crate) fn take(leases: &Leases, request_id: u64) -> Option<Held> {
        let m = map(leases);
        let cell = m.get(&request_id)?.clone();
        // Taken while the map still lists the reservation.
        let lease = cell.take()?;
        drop(m);
        Some(Held {
            cell,
            lease: Some(lease),
        })
    }

    pub(crate) fn lease(&mut self) -> Option<&mut RegionLease> {
        self.lease.as_mut()
    }

    pub(crate) fn generation(&self) -> u64 {
        self.cell.generation
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(l) = self.lease.take() {
            self.cell.put_back(l);
        }
    }
}

/// Reservations that ended while a receiver held their lease: their sequences, renamed,
/// keep the blocks until the lease is let go.
#[derive(Debug, Default)]
pub(crate) struct Parked {
    cells: Vec<(SeqId, Arc<LeaseCell>)>,
    next_id: u64,
}

impl Parked {
    /// Ends reservation `id` whose cell (already out of the shared map) is `cell`: frees its
    /// sequence now if it can take the lease (no receiver holds it; none can take it after),
    /// otherwise parks it.
    pub(crate) fn end(&mut self, cache: &mut KvCache, id: SeqId, cell: Option<Arc<LeaseCell>>) {
        match cell {
            Some(c) if c.take().is_none() => {
                let parked = self.fresh_id(cache);
                match cache.rename_sequence(id, parked) {
                    Ok(()) => self.cells.push((parked, c)),
                    // Unreachable (the id is fresh); freeing would let the receiver write
                    // free blocks, so the blocks stay with the sequence instead.
                    Err(e) => {
                        tracing::error!(request_id = id, error = %e, "cannot park a leased reservation")
                    }
                }
            }
            _ => cache.free_sequence(id),
        }
    }

    /// Frees the parked sequences whose lease is back; returns how many remain.
    pub(crate) fn reclaim(&mut self, cache: &mut KvCache) -> usize {
        self.cells.retain(|(id, c)| {
            let free = c.take().is_some();
            if free {
                cache.free_sequence(*id);
            }
            !free
        });
        self.cells.len()
    }

    pub(crate) fn len(&self) -> usize {
        self.cells.len()
    }

    /// Blocks the parked sequences hold.
    #[cfg(test)]
    pub(crate) fn blocks(&self, cache: &KvCache) -> usize {
        self.cells
            .iter()
            .map(|(id, _)| cache.sequence_blocks(*id).map_or(0, |b| b.len()))
            .sum()
    }

    fn fresh_id(&mut self, cache: &KvCache) -> SeqId {
        loop {
            self.next_id = self.next_id.wrapping_add(1);
            let id = u64::MAX - self.next_id;
            // Every parked id is a live sequence of `cache` (renamed before it is listed,
            // freed when it is taken off), so the cache alone says whether `id` is taken.
            if !cache.contains(id) {
                return id;
            }
        }
    }
}
