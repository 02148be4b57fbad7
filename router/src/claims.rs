//! What a request holds for its whole life besides its queue slot: its client-chosen id
//! (unique among requests in flight) and one unit of its client's concurrency allowance.
//!
//! Invariant: a [`Claim`] gives both back when dropped, so every way a request ends (done,
//! failed, cancelled, a panicking task) frees them; a reused id or a client over its limit
//! is refused before anything is queued or reserved on a worker.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::RouterError;

/// The router's table of claims.
#[derive(Debug)]
pub struct Claims {
    /// Most requests one client address may have in flight (0: unlimited).
    per_client_limit: usize,
    inner: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    ids: HashSet<String>,
    per_client: HashMap<IpAddr, usize>,
}

/// One request's claim; dropping it releases the id and the client's unit.
#[derive(Debug)]
pub struct Claim {
    owner: Arc<Claims>,
    id: Option<String>,
    client: Option<IpAddr>,
}

impl Claims {
    pub fn new(per_client_limit: usize) -> Arc<Self> {
        Arc::new(Claims {
            per_client_limit,
            inner: Mutex::new(Table::default()),
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // The table stays consistent under a panic (each update is one insert or remove).
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `id` (when the client chose one) and a unit of `client`'s allowance.
    pub fn claim(
        self: &Arc<Self>,
        id: Option<&str>,
        client: Option<IpAddr>,
    ) -> Result<Claim, RouterError> {
        let mut t = self.table();
        if let Some(ip) = client {
            let n = t.per_client.get(&ip).copied().unwrap_or(0);
            if self.per_client_limit > 0 && n >= self.per_client_limit {
                return Err(RouterError::ClientBusy {
                    limit: self.per_client_limit,
                });
            }
        }
        if let Some(id) = id {
            if !t.ids.insert(id.to_string()) {
                return Err(RouterError::DuplicateRequestId(id.to_string()));
            }
        }
        if let Some(ip) = client {
            *t.per_client.entry(ip).or_insert(0) += 1;
        }
        Ok(Claim {
            owner: self.clone(),
            id: id.map(str::to_string),
            client,
        })
    }

    /// Requests in flight for `client`.
    #[cfg(test)]
    fn in_flight(&self, client: IpAddr) -> usize {
        self.table().per_client.get(&client).copied().unwrap_or(0)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut t = self.owner.table();
        if let Some(id) = self.id.take() {
            t.ids.remove(&id);
        }
        if let Some(ip) = self.client {
            if let Some(n) = t.per_client.get_mut(&ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    t.per_client.remove(&ip);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn an_id_is_unique_while_in_flight_and_free_after() {
        let c = Claims::new(0);
        let first = c.claim(Some("req-1"), None).unwrap();
        let err = c.claim(Some("req-1"), None).unwrap_err();
        assert!(matches!(err, RouterError::DuplicateRequestId(ref id) if id == "req-1"));
        assert!(c.claim(Some("req-2"), None).is_ok());
        drop(first);
        assert!(c.claim(Some("req-1"), None).is_ok());
    }

    #[test]
    fn each_client_has_its_own_allowance() {
        let c = Claims::new(2);
        let a1 = c.claim(None, Some(A)).unwrap();
        let _a2 = c.claim(None, Some(A)).unwrap();
        assert!(matches!(
            c.claim(None, Some(A)),
            Err(RouterError::ClientBusy { limit: 2 })
        ));
        // Another client is not affected.
        let _b = c.claim(None, Some(B)).unwrap();
        drop(a1);
        assert_eq!(c.in_flight(A), 1);
        assert!(c.claim(None, Some(A)).is_ok());
    }

    #[test]
    fn a_refused_claim_takes_nothing() {
        let c = Claims::new(1);
        let _held = c.claim(Some("x"), Some(A)).unwrap();
        // Over the client limit: the id must not stay claimed.
        assert!(c.claim(Some("y"), Some(A)).is_err());
        assert!(c.claim(Some("y"), Some(B)).is_ok());
        // Duplicate id: the client's unit must not be taken.
        assert!(c.claim(Some("x"), Some(B)).is_err());
        assert_eq!(c.in_flight(B), 0);
    }
}
