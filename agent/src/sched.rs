//! Scheduling of the control-loop thread.

use std::time::Duration;
use tracing::{info, warn};

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

/// Gives the control-loop thread a higher CPU priority (a negative nice value), so that
/// offline processes competing for CPU (those just resumed, above all) do not delay
/// decisions and confirmations, and a short scheduler slice, so that a doorbell's wake-up
/// preempts the thread running on the CPU instead of waiting for its slice to end. Or,
/// with `rt` > 0, SCHED_FIFO. Priorities need CAP_SYS_NICE (root has it); without it the
/// loop runs at normal priority and says so. These calls act on the calling thread only.
pub(crate) fn raise_priority(nice: i32, rt: i32, slice: Duration) {
    if rt > 0 {
        let param = libc::sched_param { sched_priority: rt };
        // SAFETY: a valid sched_param; tid 0 is the calling thread.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } == 0 {
            info!(
                priority = rt,
                "Control loop runs at real-time priority (SCHED_FIFO)"
            );
            return;
        }
        let error = std::io::Error::last_os_error();
        warn!(priority = rt, %error, "Cannot give the control loop real-time priority (needs CAP_SYS_NICE); using --loop-nice");
    }
    if !slice.is_zero() {
        let slice_us = slice.as_micros() as u64;
        match set_slice(nice, slice.as_nanos() as u64) {
            Ok(()) => {
                info!(
                    nice,
                    slice_us,
                    "Control loop runs at raised CPU priority with a short scheduler slice"
                );
                return;
            }
            Err(error) => match set_slice(own_nice(), slice.as_nanos() as u64) {
                Ok(()) => {
                    warn!(nice, %error, slice_us, "Cannot raise the control loop's CPU priority (needs CAP_SYS_NICE); it keeps its nice value, with a short scheduler slice");
                    return;
                }
                Err(error) => {
                    warn!(slice_us, %error, "Cannot set the control loop's scheduler slice (sched_setattr); using --loop-nice alone")
                }
            },
        }
    }
    if nice == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    match rustix::process::setpriority_process(Some(tid), nice) {
        Ok(()) => info!(nice, "Control loop runs at raised CPU priority"),
        Err(error) => {
            warn!(nice, %error, "Cannot raise the control loop's CPU priority (needs CAP_SYS_NICE); running at normal priority")
        }
    }
}

/// The kernel's CPU latency request device (PM QoS): while a file description on it holds
/// a value, the cpuidle governor keeps every CPU out of idle states that take longer than
/// that to leave. Closing it (the agent's exit, a crash included) withdraws the request.
pub const CPU_LATENCY_DEVICE: &str = "/dev/cpu_dma_latency";

/// What the device reads when nobody holds a request (the kernel's default, 2000 s).
pub const NO_CPU_LATENCY_REQUEST_US: i32 = 2_000_000_000;

/// A CPU wake-up latency request, held until dropped.
#[derive(Debug)]
pub struct CpuWakeLatency {
    _file: std::fs::File,
    us: i32,
}

impl CpuWakeLatency {
    /// Asks that idle CPUs wake within `latency` (whole microseconds, rounded down), by
    /// writing it as a native-endian `s32` to `device` (the kernel also takes a hex
    /// string; the binary form is what tuned and `cyclictest` write). Needs write access
    /// to the device (root, and in a container the device node itself).
    pub fn hold(device: &std::path::Path, latency: Duration) -> std::io::Result<Self> {
        use std::io::Write;
        let us = i32::try_from(latency.as_micros()).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{latency:?} is beyond the kernel's range"),
            )
        })?;
        let mut file = std::fs::OpenOptions::new().write(true).open(device)?;
        file.write_all(&us.to_ne_bytes())?;
        Ok(Self { _file: file, us })
    }

    /// The value held, µs.
    pub fn micros(&self) -> i32 {
        self.us
    }
}

/// The request in force now (the lowest one held by anyone), µs, read from `device`.
pub fn cpu_latency_in_force(device: &std::path::Path) -> std::io::Result<i32> {
    use std::io::Read;
    let mut b = [0u8; 4];
    std::fs::File::open(device)?.read_exact(&mut b)?;
    Ok(i32::from_ne_bytes(b))
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
    fn a_cpu_latency_request_is_written_as_the_kernel_reads_it() {
        let dir = crate::testutil::TmpDir::new("coloc-cpu-latency");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("device");
        for (latency, want) in [
            (Duration::from_micros(37), 37),
            (Duration::from_nanos(1_500), 1),
            (Duration::ZERO, 0),
        ] {
            std::fs::write(&path, b"").unwrap();
            let held = CpuWakeLatency::hold(&path, latency).unwrap();
            assert_eq!(held.micros(), want);
            assert_eq!(std::fs::read(&path).unwrap(), want.to_ne_bytes());
            assert_eq!(cpu_latency_in_force(&path).unwrap(), want);
        }
        let err = CpuWakeLatency::hold(&path, Duration::from_secs(3000)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        let err = CpuWakeLatency::hold(&dir.join("missing"), Duration::ZERO).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }

    /// On the real device: the request is in force while held and gone when dropped.
    #[test]
    fn the_kernel_keeps_the_request_while_it_is_held() {
        let dev = std::path::Path::new(CPU_LATENCY_DEVICE);
        let before = match cpu_latency_in_force(dev) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("NOTE: {CPU_LATENCY_DEVICE} cannot be read here ({e}): checked that holding a request fails with an error");
                assert!(CpuWakeLatency::hold(dev, Duration::from_micros(3)).is_err());
                return;
            }
        };
        let held = match CpuWakeLatency::hold(dev, Duration::from_micros(3)) {
            Ok(h) => h,
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::NotFound
                    ),
                    "{e}"
                );
                eprintln!("NOTE: {CPU_LATENCY_DEVICE} is not writable here ({e}): only the error path was checked");
                return;
            }
        };
        let during = cpu_latency_in_force(dev).unwrap();
        assert!(
            during <= 3,
            "request of 3 µs held, the kernel enforces {during} µs"
        );
        drop(held);
        let after = cpu_latency_in_force(dev).unwrap();
        if before <= 3 {
            eprintln!("NOTE: another request of {before} µs was in force: the withdrawal could not be seen");
        } else {
            assert!(
                after > 3,
                "the request outlived its holder: {after} µs in force after the drop"
            );
        }
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
