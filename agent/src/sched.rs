//! Scheduling of the control-loop thread.

/// `struct sched_attr` (`SCHED_ATTR_SIZE_VER1`, 56 bytes).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
    sched_util_min: u32,
    sched_util_max: u32,
}

/// Puts the calling thread in `SCHED_OTHER` at `nice` with an EEVDF slice of `slice_ns`
/// (`sched_setattr`'s `sched_runtime`; Linux ≥ 6.12 honours it, clamped to 0.1–100 ms,
/// and lets a task with a shorter slice preempt the running one when it wakes; older
/// kernels ignore it). A negative `nice` needs CAP_SYS_NICE.
pub fn set_slice(nice: i32, slice_ns: u64) -> std::io::Result<()> {
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_nice: nice,
        sched_runtime: slice_ns,
        ..Default::default()
    };
    // SAFETY: a valid, fully initialised sched_attr of the size it states; pid 0 is the
    // calling thread; flags 0.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0u32) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The calling thread's nice value.
pub fn own_nice() -> i32 {
    // SAFETY: getpriority reads the calling thread's (who 0) nice value; -1 is also a
    // valid answer, and any other failure cannot happen for the calling thread.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slice the kernel reports for the calling thread (`se.slice`, Linux ≥ 6.6).
    fn own_slice() -> Option<u64> {
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched")).ok()?;
        s.lines()
            .find(|l| l.starts_with("se.slice"))?
            .split(':')
            .nth(1)?
            .trim()
            .parse()
            .ok()
    }

    #[test]
    fn the_loop_thread_gets_the_slice_it_asks_for() {
        std::thread::spawn(|| {
            set_slice(own_nice(), 100_000).expect("sched_setattr at its own nice value needs no privilege");
            match own_slice() {
                Some(ns) => assert_eq!(ns, 100_000, "the kernel did not take the slice"),
                None => eprintln!(
                    "NOTE: this kernel does not show se.slice (before Linux 6.6): only checked that sched_setattr accepts the request"
                ),
            }
        })
        .join()
        .unwrap();
    }
}
