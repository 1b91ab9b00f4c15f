//! The GPUs this process submits to, indexed like its page's entries: each GPU's page
//! entry and its gate slot in the current mapping, and which GPU a context is on.

use super::events::with_ctx;
use super::map::{mapping, Mapping};
use coloc_doorbell::gate::Slot;
use coloc_doorbell::{Entry, MAX_GPUS};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering::*};
use std::sync::OnceLock;

pub(super) struct Gpu {
    /// The page entry (null until registered).
    pub(super) entry: AtomicPtr<Entry>,
    pub(super) uuid: OnceLock<[u8; 16]>,
    /// `mapping epoch (24 bits) | generation (32) | slot index (8, 0xff: none)`, or 0.
    pub(super) slot: AtomicU64,
    /// Stream rings of this process on this GPU (the budget's share of each).
    pub(super) rings: AtomicU32,
}

pub(super) static GPUS: [Gpu; MAX_GPUS] = [const {
    Gpu {
        entry: AtomicPtr::new(std::ptr::null_mut()),
        uuid: OnceLock::new(),
        slot: AtomicU64::new(0),
        rings: AtomicU32::new(0),
    }
}; MAX_GPUS];

const NO_SLOT: u64 = 0xff;

impl Gpu {
    pub(super) fn entry(&self) -> Option<&'static Entry> {
        let e = self.entry.load(Acquire);
        // SAFETY: a non-null pointer is an entry of the process's page (never unmapped).
        (!e.is_null()).then(|| unsafe { &*e })
    }

    /// This GPU's gate slot in the current mapping, if the agent manages it.
    pub(super) fn gate(&self) -> Option<(&'static Mapping, &'static Slot)> {
        let m = mapping()?;
        let gen = m.gates.generation();
        let idx = match cached(self.slot.load(Relaxed), m.epoch, gen) {
            Cached::Slot(i) => Some(i),
            Cached::None => None,
            Cached::Unknown => {
                let idx = self.uuid.get().and_then(|u| m.gates.find_index(u));
                self.slot.store(cache_word(m.epoch, gen, idx), Relaxed);
                idx
            }
        };
        m.gates.slot(idx?).map(|s| (m, s))
    }
}

/// What a GPU's cached slot word says.
#[derive(Debug, PartialEq, Eq)]
enum Cached {
    /// The GPU has this slot in the mapping.
    Slot(usize),
    /// No slot as of this generation: look again only once it moved (a claim bumps it).
    None,
    /// Made for another mapping, or never: look it up.
    Unknown,
}

/// The cached slot word (`mapping epoch (24 bits) | generation (32) | slot index (8,
/// 0xff: none)`) read for mapping `epoch` at generation `gen`.
fn cached(word: u64, epoch: u32, gen: u32) -> Cached {
    if word >> 40 != u64::from(epoch) & 0xff_ffff {
        return Cached::Unknown;
    }
    match word & 0xff {
        NO_SLOT if (word >> 8) as u32 == gen => Cached::None,
        NO_SLOT => Cached::Unknown,
        i => Cached::Slot(i as usize),
    }
}

/// The word [`cached`] reads: `idx` found in mapping `epoch` at generation `gen`.
fn cache_word(epoch: u32, gen: u32, idx: Option<usize>) -> u64 {
    let idx = idx.map_or(NO_SLOT, |i| i as u64 & 0xff);
    ((u64::from(epoch) & 0xff_ffff) << 40) | (u64::from(gen) << 8) | idx
}

/// The GPU index for `uuid`, registering it (page entry claimed) if new.
fn gpu_for_uuid(uuid: &[u8; 16]) -> Option<usize> {
    let page = crate::page::page()?;
    let e = page.entry_for(uuid)?;
    let i = page.index_of(e)?;
    let g = &GPUS[i];
    let _ = g.uuid.set(*uuid);
    g.entry.store(e as *const Entry as *mut Entry, Release);
    Some(i)
}

thread_local! {
    /// (context, GPU index + 1) of this thread's latest submission on a default stream.
    static CTX_GPU: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// The GPU of the calling thread's current context `ctx`.
pub(super) fn gpu_of_current(ctx: usize) -> Option<usize> {
    let (c, g) = CTX_GPU.try_with(|x| x.get()).unwrap_or((0, 0));
    if c == ctx && g != 0 {
        return Some(g - 1);
    }
    let g = gpu_for_uuid(&crate::driver::current_uuid()?)?;
    let _ = CTX_GPU.try_with(|x| x.set((ctx, g + 1)));
    Some(g)
}

/// The GPU of context `ctx` (any thread's).
pub(super) fn gpu_of_ctx(ctx: usize) -> Option<usize> {
    let cur = crate::driver::current_ctx();
    if ctx == cur {
        return gpu_of_current(ctx);
    }
    let uuid = with_ctx(ctx, crate::driver::current_uuid)?;
    gpu_for_uuid(&uuid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_cache_is_per_mapping_and_generation() {
        assert_eq!(cached(0, 1, 0), Cached::Unknown, "never looked up");
        let w = cache_word(1, 5, Some(3));
        assert_eq!(cached(w, 1, 5), Cached::Slot(3));
        assert_eq!(
            cached(w, 1, 9),
            Cached::Slot(3),
            "a slot stays while the mapping does"
        );
        assert_eq!(cached(w, 2, 5), Cached::Unknown, "another mapping");
        let none = cache_word(1, 5, None);
        assert_eq!(cached(none, 1, 5), Cached::None);
        assert_eq!(cached(none, 1, 6), Cached::Unknown, "the generation moved");
        let w = cache_word(1 << 24 | 7, u32::MAX, Some(0));
        assert_eq!(
            cached(w, 7, u32::MAX),
            Cached::Slot(0),
            "epochs compare in 24 bits"
        );
    }
}
