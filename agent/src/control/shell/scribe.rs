//! The scribe: writes the fail-open record for the controller's record book, off the
//! loop's thread, one write at a time and in the order asked, so that a slow state
//! directory (an `fdatasync` of tens of milliseconds) delays no GPU's preemption. The
//! answer ([`Obs::Written`]) comes back through a channel, and the scribe wakes the loop
//! when it lands. The ordering that makes the record safe is the controller's: nothing is
//! started before the write that holds it has landed.
//!
//! Inline (the loop tests, `LoopConfig::record_off_loop` false): the write is made on the
//! loop's thread, and its answer comes back in the same round.
//!
//! May touch: the state directory, through the record store.

use crate::control::io::Obs;
use crate::control::record::Write;
use crate::edges::doorbell::Waker;
use crate::edges::record::RecordStore;
use std::sync::mpsc;
use std::time::Duration;
use tracing::error;

/// What the loop asks for the record's writes through: the [`Scribe`] (tests: a model of
/// a state directory whose writes land when it says).
pub trait Writer: Send {
    /// Asks for `w`; its answer when it is made at once.
    fn write(&mut self, w: Write) -> Option<Obs>;
    /// The answers that came since the last call.
    fn landed(&mut self) -> Vec<Obs>;
    /// Waits up to `timeout` for the next answer (the agent stops).
    fn wait(&mut self, timeout: Duration) -> Option<Obs>;
}

impl Writer for Scribe {
    fn write(&mut self, w: Write) -> Option<Obs> {
        Scribe::write(self, w)
    }
    fn landed(&mut self) -> Vec<Obs> {
        Scribe::landed(self)
    }
    fn wait(&mut self, timeout: Duration) -> Option<Obs> {
        Scribe::wait(self, timeout)
    }
}

/// See the module.
pub enum Scribe {
    /// Writes on the loop's thread.
    Inline(Box<dyn RecordStore>),
    /// Writes on its own thread.
    Thread {
        /// Writes to make.
        tx: Option<mpsc::Sender<Write>>,
        /// Their answers.
        rx: mpsc::Receiver<(u64, bool)>,
        /// The thread.
        handle: Option<std::thread::JoinHandle<()>>,
    },
}

impl std::fmt::Debug for Scribe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scribe::Inline(_) => "Scribe::Inline",
            Scribe::Thread { .. } => "Scribe::Thread",
        })
    }
}

fn write(record: &mut dyn RecordStore, w: &Write) -> bool {
    match record.update(&w.add, &w.remove) {
        Ok(()) => true,
        Err(err) => {
            error!(error = %format!("{err:#}"), added = w.add.len(), removed = w.remove.len(), "Cannot write the suspension record");
            false
        }
    }
}

impl Scribe {
    /// A scribe on its own thread, waking the loop through `waker` when a write lands.
    pub fn spawn(mut record: Box<dyn RecordStore>, waker: Waker) -> std::io::Result<Scribe> {
        let (tx, jobs) = mpsc::channel::<Write>();
        let (done, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("coloc-record".into())
            .spawn(move || {
                for w in jobs {
                    let ok = write(record.as_mut(), &w);
                    if done.send((w.id, ok)).is_err() {
                        return;
                    }
                    waker.wake();
                }
            })?;
        Ok(Scribe::Thread {
            tx: Some(tx),
            rx,
            handle: Some(handle),
        })
    }

    /// Asks for `w`; its answer when it is made at once (inline).
    pub fn write(&mut self, w: Write) -> Option<Obs> {
        match self {
            Scribe::Inline(record) => {
                let ok = write(record.as_mut(), &w);
                Some(Obs::Written { id: w.id, ok })
            }
            Scribe::Thread { tx, .. } => {
                let id = w.id;
                if tx.as_ref().is_some_and(|tx| tx.send(w).is_ok()) {
                    None
                } else {
                    error!("The record writer is gone: not recording");
                    Some(Obs::Written { id, ok: false })
                }
            }
        }
    }

    /// The answers that came since the last call.
    pub fn landed(&mut self) -> Vec<Obs> {
        match self {
            Scribe::Inline(_) => Vec::new(),
            Scribe::Thread { rx, .. } => rx
                .try_iter()
                .map(|(id, ok)| Obs::Written { id, ok })
                .collect(),
        }
    }

    /// Waits up to `timeout` for the next answer (the agent stops).
    pub fn wait(&mut self, timeout: Duration) -> Option<Obs> {
        match self {
            Scribe::Inline(_) => None,
            Scribe::Thread { rx, .. } => rx
                .recv_timeout(timeout)
                .ok()
                .map(|(id, ok)| Obs::Written { id, ok }),
        }
    }
}

impl Drop for Scribe {
    fn drop(&mut self) {
        if let Scribe::Thread { tx, handle, .. } = self {
            // The writes asked for are made before the thread ends.
            tx.take();
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}
