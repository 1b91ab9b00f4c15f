//! Fakes of the actuator and the doorbells.

use super::FakeClock;
use crate::edges::actuator::{Actuator, Op, Progress, RecordEntry, Target};
use std::collections::BTreeSet;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One actuator call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Suspend or resume.
    pub op: Op,
    /// The targets, as recorded.
    pub targets: Vec<RecordEntry>,
    /// Targets of a suspension that were not on disk when it started (must stay empty).
    pub unrecorded: Vec<RecordEntry>,
    /// The loop's clock when it was made (with [`FakeActuator::clock`]).
    pub at_ns: Option<u64>,
}

/// An actuator that remembers, with targets that fail or never confirm on demand.
#[derive(Debug, Default, Clone)]
pub struct FakeActuator {
    /// Calls of `start`.
    pub calls: Arc<Mutex<Vec<Call>>>,
    /// The record's disk, to check that suspensions are written first.
    pub disk: Arc<Mutex<BTreeSet<RecordEntry>>>,
    /// Targets whose suspension fails.
    pub fail: Arc<Mutex<BTreeSet<RecordEntry>>>,
    /// Targets whose suspension never confirms.
    pub stuck: Arc<Mutex<BTreeSet<RecordEntry>>>,
    /// Targets something else resumed (a tenant's SIGCONT): running until stopped again.
    pub resumed_by_tenant: Arc<Mutex<BTreeSet<RecordEntry>>>,
    /// The loop's clock, moved by `act_ns` per start (simulated actuation time).
    pub clock: Option<FakeClock>,
    /// Simulated actuation time.
    pub act_ns: u64,
}

impl FakeActuator {
    /// Like a real actuator, waits out the budget (real time) when a target does not
    /// confirm, so a loop that waits too long shows it.
    fn wait_if_stuck(&self, targets: &[Target], op: Op, budget: Duration) {
        if targets
            .iter()
            .any(|t| matches!(self.answer(t, op), Progress::Pending))
        {
            std::thread::sleep(budget.min(Duration::from_secs(2)));
        }
    }
    /// The calls so far.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
    fn answer(&self, t: &Target, op: Op) -> Progress {
        let r = t.record();
        if op == Op::Suspend && self.fail.lock().unwrap().contains(&r) {
            return Progress::Failed(crate::edges::actuator::ActError::Signal {
                pid: 0,
                source: io::ErrorKind::PermissionDenied.into(),
            });
        }
        if op == Op::Suspend && self.stuck.lock().unwrap().contains(&r) {
            return Progress::Pending;
        }
        Progress::Done
    }
}

impl Actuator for FakeActuator {
    fn start(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        self.wait_if_stuck(targets, op, budget);
        let disk = self.disk.lock().unwrap().clone();
        let recs: Vec<RecordEntry> = targets.iter().map(Target::record).collect();
        let unrecorded = if op == Op::Suspend {
            recs.iter().filter(|r| !disk.contains(r)).cloned().collect()
        } else {
            vec![]
        };
        if op == Op::Suspend {
            let mut r = self.resumed_by_tenant.lock().unwrap();
            for t in &recs {
                r.remove(t);
            }
        }
        self.calls.lock().unwrap().push(Call {
            op,
            targets: recs,
            unrecorded,
            at_ns: self
                .clock
                .as_ref()
                .map(|c| c.0.load(std::sync::atomic::Ordering::SeqCst)),
        });
        if let Some(c) = &self.clock {
            c.advance(self.act_ns);
        }
        targets.iter().map(|t| self.answer(t, op)).collect()
    }
    fn check(&mut self, targets: &[Target], op: Op, budget: Duration) -> Vec<Progress> {
        self.wait_if_stuck(targets, op, budget);
        let resumed = self.resumed_by_tenant.lock().unwrap().clone();
        targets
            .iter()
            .map(|t| match op {
                Op::Suspend if resumed.contains(&t.record()) => Progress::Pending,
                _ => self.answer(t, op),
            })
            .collect()
    }
}

/// The UUID bytes of fake GPU `gpu`.
pub fn fake_uuid(gpu: u32) -> [u8; 16] {
    let mut u = [0xc0, 0x10, 0xc5, 0x17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    u[12..].copy_from_slice(&gpu.to_be_bytes());
    u
}

/// Doorbell pages the test writes by hand; `wait` returns at once.
#[derive(Debug, Clone, Default)]
pub struct FakeBells {
    /// Shared state.
    pub state: Arc<Mutex<FakeBellState>>,
}

/// What [`FakeBells`] serves.
#[derive(Debug, Default)]
pub struct FakeBellState {
    /// Mapped pages.
    pub pages: Vec<crate::edges::doorbell::PageInfo>,
    /// Current readings.
    pub readings: Vec<crate::edges::doorbell::BellReading>,
    /// The page set changed since the last rescan.
    pub changed: bool,
    /// Timeouts the loop asked to sleep for.
    pub waits: Vec<std::time::Duration>,
    /// `rang()` answers true from its call number `n + 1` on (None: never).
    pub rang_after: Option<u32>,
    /// Calls of `rang()` so far.
    pub rang_calls: u32,
    /// Launch-gate fields per page.
    pub gates: std::collections::HashMap<u64, Vec<coloc_doorbell::GateReading>>,
    /// The pages the loop last asked to be waited on first.
    pub preferred: Vec<u64>,
    /// Page `.0`'s shim has nothing in flight: it acknowledges each gate that the gate
    /// file at `.1` has closed as soon as the page is read.
    pub acks_at_once: Option<(u64, std::path::PathBuf)>,
}

/// The gate words of the gate file at `path`: (UUID, closed epoch or 0), as a shim reads
/// them.
pub fn gate_words(path: &std::path::Path) -> Vec<([u8; 16], u32)> {
    use coloc_doorbell::gate::{Gates, GATE_FILE_SIZE};
    let bytes = std::fs::read(path).unwrap();
    let mut buf = vec![0u64; GATE_FILE_SIZE / 8];
    for (i, w) in buf.iter_mut().enumerate() {
        *w = u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    }
    // SAFETY: an 8-aligned private buffer of GATE_FILE_SIZE bytes, alive for the call.
    let g = unsafe { Gates::from_raw(buf.as_ptr().cast()) };
    g.read().into_iter().map(|(_, u, c, _)| (u, c)).collect()
}

impl FakeBells {
    /// Adds page `id` claiming `owner`, its file owned by `file_uid`.
    pub fn page(&self, id: u64, owner: crate::edges::doorbell::Owner, file_uid: u32) {
        let owner_pid = match &owner {
            crate::edges::doorbell::Owner::Pid(p) => Some(*p),
            crate::edges::doorbell::Owner::Pod(_) => None,
        };
        let mut s = self.state.lock().unwrap();
        s.pages.push(crate::edges::doorbell::PageInfo {
            id,
            path: format!("/fake/{id}.bell").into(),
            owner,
            file_uid,
            wake_gap_ns: coloc_doorbell::DEFAULT_WAKE_GAP_NS,
            pid: match &owner_pid {
                Some(p) => *p,
                None => 0,
            },
            class: coloc_doorbell::CLASS_ONLINE,
        });
        s.changed = true;
    }
    /// Adds an offline page `id` claiming `owner` (the launch gate's acknowledgements).
    pub fn offline_page(&self, id: u64, owner: crate::edges::doorbell::Owner, file_uid: u32) {
        self.page(id, owner, file_uid);
        let mut s = self.state.lock().unwrap();
        s.pages.last_mut().expect("just added").class = coloc_doorbell::CLASS_OFFLINE;
    }
    /// Page `id`'s writer wakes the agent after gaps of `ns` (`COLOC_SHIM_WAKE_GAP_MS`).
    pub fn set_wake_gap(&self, id: u64, ns: u64) {
        let mut s = self.state.lock().unwrap();
        if let Some(p) = s.pages.iter_mut().find(|p| p.id == id) {
            p.wake_gap_ns = ns;
        }
        s.changed = true;
    }
    /// Page `id`'s writer gives `pid` for itself (its PID in its own namespace).
    pub fn set_pid(&self, id: u64, pid: u32) {
        let mut s = self.state.lock().unwrap();
        if let Some(p) = s.pages.iter_mut().find(|p| p.id == id) {
            p.pid = pid;
        }
    }
    /// Offline page `id` acknowledges `epoch` for `gpu`.
    pub fn ack(&self, id: u64, gpu: u32, epoch: u32) {
        let mut s = self.state.lock().unwrap();
        let g = s.gates.entry(id).or_default();
        g.retain(|r| r.uuid != fake_uuid(gpu));
        g.push(coloc_doorbell::GateReading {
            index: gpu as usize,
            uuid: fake_uuid(gpu),
            gate_ack: epoch,
            inflight: 0,
            in_submit: 0,
            blocked_ns: 0,
            submitted: 0,
        });
    }
    /// Page `id` says: a run on `gpu` since `since`, latest launch `last`.
    pub fn ring(&self, id: u64, gpu: u32, since: u64, last: u64) {
        self.ring_drained(id, gpu, since, last, 0);
    }
    /// As [`Self::ring`], with the page's completion stamp `drained`.
    pub fn ring_drained(&self, id: u64, gpu: u32, since: u64, last: u64, drained: u64) {
        let mut s = self.state.lock().unwrap();
        s.readings
            .retain(|r| !(r.page == id && r.reading.index == gpu as usize));
        s.readings.push(crate::edges::doorbell::BellReading {
            page: id,
            reading: coloc_doorbell::Reading {
                index: gpu as usize,
                uuid: fake_uuid(gpu),
                last_launch_ns: last,
                busy_since_ns: since,
            },
            drained_ns: drained,
        });
    }
}

impl crate::edges::doorbell::Doorbells for FakeBells {
    fn rescan(&mut self, _force: bool) -> bool {
        std::mem::take(&mut self.state.lock().unwrap().changed)
    }
    fn pages(&self) -> Vec<crate::edges::doorbell::PageInfo> {
        self.state.lock().unwrap().pages.clone()
    }
    fn read(&mut self, out: &mut Vec<crate::edges::doorbell::BellReading>) {
        out.extend(self.state.lock().unwrap().readings.iter().copied());
    }
    fn wait(&mut self, timeout: std::time::Duration) -> bool {
        self.state.lock().unwrap().waits.push(timeout);
        false
    }
    fn waker(&self) -> crate::edges::doorbell::Waker {
        crate::edges::doorbell::Waker::default()
    }
    fn rang(&self) -> bool {
        let mut st = self.state.lock().unwrap();
        st.rang_calls += 1;
        st.rang_after.is_some_and(|n| st.rang_calls > n)
    }
    fn prefer(&mut self, pages: &[u64]) {
        self.state.lock().unwrap().preferred = pages.to_vec();
    }
    fn read_gate(&self, page: u64, out: &mut Vec<coloc_doorbell::GateReading>) {
        let at_once = self.state.lock().unwrap().acks_at_once.clone();
        if let Some((id, path)) = at_once.filter(|(id, _)| *id == page) {
            for (uuid, epoch) in gate_words(&path) {
                let gpu = u32::from_be_bytes(uuid[12..].try_into().unwrap());
                if epoch != 0 && uuid == fake_uuid(gpu) {
                    self.ack(id, gpu, epoch);
                }
            }
        }
        if let Some(g) = self.state.lock().unwrap().gates.get(&page) {
            out.extend(g.iter().copied());
        }
    }
}
