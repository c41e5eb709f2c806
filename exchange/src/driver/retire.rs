//! Shrinking the cluster: [`Driver::retire_worker`] takes one worker out for good without
//! losing a row or re-running a map.
//!
//! Every shuffle still registered must be durable (each committed map wrote its object) and
//! sealed. Each is then read through the store ([`crate::direct`]): every worker is handed the
//! map objects with a second seal, and readers, on the workers and on the driver, fetch their
//! partitions by range from then on, so nothing of it is needed from any worker's memory or
//! disk. A shuffle that does not qualify refuses the removal, naming it, before anything
//! changes.
//!
//! Slots stay numbered `0..N`, so the placement formulas (partition p's owner is p mod N)
//! keep holding for what runs next: the last slot's process moves into the retired slot, with
//! a new generation there, and the manifests follow it (its holdings are renamed to the new
//! slot; the retired process's are marked gone). The runtime (the local cluster, Ray) stops
//! the retired process once the driver has let go of it.

use super::{Driver, Retired, REPLACE_TIMEOUT};
use crate::block::ShuffleId;
use crate::error::{Error, Result};
use crate::sync::lock;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A generation no process has: holders marked with it are gone.
const GONE: u64 = u64::MAX;

impl Driver {
    /// Take worker slot `worker` out of the cluster (see the module doc); the cluster has one
    /// slot fewer after. Refused, with nothing changed, when it is the last worker, a worker
    /// is lost and not back yet, or a registered shuffle is not durable or not sealed.
    pub async fn retire_worker(self: &Arc<Self>, worker: usize) -> Result<Retired> {
        let n = self.num_workers();
        if worker >= n {
            return Err(Error::invalid(format!(
                "no worker {worker} in a cluster of {n}"
            )));
        }
        if n < 2 {
            return Err(Error::invalid(
                "the cluster's last worker cannot be removed",
            ));
        }
        self.wait_all_live(REPLACE_TIMEOUT).await?;
        self.settle().await;
        let shuffles = self.registered();
        for &s in &shuffles {
            self.check_retirable(s, worker)?;
        }
        let mut through_store = 0;
        for &s in &shuffles {
            if !self.via_store(s) {
                through_store += 1;
                self.update_shuffle(s, |e| {
                    e.via_store = true;
                    // A slot's replacement registers it read through the store too.
                    if let Some(st) = e.created.as_mut().and_then(|(m, _)| m.storage.as_mut()) {
                        st.read_through = true;
                    }
                });
            }
            // Every worker gets the objects to read it from.
            self.seal(s).await?;
        }
        let addr = self.worker(worker)?.addr;
        let moved_from = self.move_last_slot_to(worker)?;
        tracing::warn!(worker, %addr, ?moved_from, through_store, "worker retired");
        self.event(
            "worker_removed",
            || serde_json::json!({"worker": worker, "moved_from": moved_from, "workers": n - 1}),
        );
        Ok(Retired {
            addr,
            moved_from,
            through_store,
        })
    }

    /// The shuffles registered now, by id.
    fn registered(&self) -> Vec<ShuffleId> {
        let mut ids: Vec<ShuffleId> = lock(&self.shuffles)
            .iter()
            .filter(|(_, e)| e.created.is_some())
            .map(|(id, _)| *id)
            .collect();
        ids.sort_by_key(|s| s.0);
        ids
    }

    /// Whether `shuffle` can lose `worker`: durable, sealed, and every committed map has its
    /// object; otherwise the error a user can act on.
    fn check_retirable(&self, shuffle: ShuffleId, worker: usize) -> Result<()> {
        let refuse = |why: String| {
            Err(Error::invalid(format!(
                "worker {worker} cannot be removed: shuffle {shuffle} {why}"
            )))
        };
        if !self.is_durable(shuffle) {
            return refuse(
                "is not durable (the cluster has no storage=): its blocks live only on the \
                 workers. Drop it (finish or close what reads it) first, or run with storage="
                    .into(),
            );
        }
        if !self.with_shuffle(shuffle, |e| e.sealed).unwrap_or(false) {
            return refuse(
                "is still being written (its map side is not complete): remove the worker \
                 once the job writing it has finished"
                    .into(),
            );
        }
        match self.map_objects(shuffle) {
            Ok(_) => Ok(()),
            Err(e) => refuse(format!("cannot be read from the store alone: {e}")),
        }
    }

    /// Move the last slot's process into slot `to` (nothing moves when `to` is the last) and
    /// shrink the cluster by one slot; the manifests follow. Returns the slot that moved.
    fn move_last_slot_to(&self, to: usize) -> Result<Option<usize>> {
        let last = self.num_workers() - 1;
        let (old_last, new_gen) = (
            self.generation(last),
            self.generation(to).max(self.generation(last)) + 1,
        );
        {
            let mut slots = self.workers.write().unwrap_or_else(|p| p.into_inner());
            let mut moved = slots
                .pop()
                .ok_or_else(|| Error::invalid("no worker to remove"))?;
            if to != last {
                moved.index = to;
                let slot = slots
                    .get_mut(to)
                    .ok_or_else(|| Error::invalid(format!("no worker slot {to}")))?;
                *slot = moved;
            }
        }
        if to != last {
            self.alive[to].store(self.is_alive(last), Ordering::SeqCst);
            self.generations[to].store(new_gen, Ordering::SeqCst);
        }
        self.alive[last].store(false, Ordering::SeqCst);
        self.active.store(last, Ordering::SeqCst);
        // A holder (slot, generation) of the last slot's process is now (to, new_gen); one of
        // the retired process is gone.
        let rename = |slot: &mut usize, g: &mut u64| {
            if *slot == to && to != last {
                *g = GONE;
            } else if *slot == last && *g == old_last {
                (*slot, *g) = (to, new_gen);
            }
        };
        for e in lock(&self.shuffles).values_mut() {
            if let Some((_, gens)) = e.created.as_mut() {
                rename_generations(gens, to, last, old_last, new_gen);
            }
            for made in e.outputs.values_mut() {
                for (slot, g) in made.holders.iter_mut() {
                    rename(slot, g);
                }
                if made.worker == last {
                    made.worker = to;
                }
            }
            e.blocks.retain(|b| b.worker != to || to == last);
            for b in e.blocks.iter_mut().filter(|b| b.worker == last) {
                b.worker = to;
            }
        }
        for coded in lock(&self.parity).maps.values_mut() {
            rename_generations(&mut coded.generations, to, last, old_last, new_gen);
        }
        self.live.send_modify(|v| *v += 1);
        Ok((to != last).then_some(last))
    }
}

/// Per-slot generations recorded at some point (where a shuffle was registered, what a
/// parity map saw): the last slot's entry moves to `to` (as `new_gen` when it was the moved
/// process's), the retired process's is gone, and the list loses its last slot.
fn rename_generations(gens: &mut Vec<u64>, to: usize, last: usize, old_last: u64, new_gen: u64) {
    if to != last {
        let moved = match gens.get(last) {
            Some(&g) if g == old_last => new_gen,
            _ => GONE,
        };
        if let Some(g) = gens.get_mut(to) {
            *g = moved;
        }
    }
    gens.truncate(last);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_slot_moves_into_the_retired_one() {
        let mut gens = vec![0, 3, 0, 2];
        rename_generations(&mut gens, 1, 3, 2, 4);
        assert_eq!(gens, vec![0, 4, 0]);
        // Registered on the last slot's earlier process only: gone on the moved one.
        let mut gens = vec![0, 0, 1];
        rename_generations(&mut gens, 0, 2, 2, 3);
        assert_eq!(gens, vec![GONE, 0]);
        // Retiring the last slot moves nothing.
        let mut gens = vec![5, 6];
        rename_generations(&mut gens, 1, 1, 6, 7);
        assert_eq!(gens, vec![5]);
    }
}
