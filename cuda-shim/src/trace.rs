//! `COLOC_SHIM_TRACE=1`: one stderr line per distinct driver entry point the process asks
//! for, through `dlsym` (names starting with `cu`) or a getter (`cuGetProcAddress[_v2]`:
//! every name, with the CUDA version and flags asked for), and whether the shim wrapped
//! it. For learning what a CUDA stack (runtime, cuBLAS, Triton, NCCL) looks up on a real
//! driver — for example a submission entry point the shim does not know yet. Off by
//! default; never on a launch path (lookups happen at start-up and on first use).

use std::collections::HashSet;
use std::ffi::c_int;
use std::sync::{Mutex, OnceLock};

/// Distinct requests logged at most (then one line says the rest are not).
const MAX: usize = 4096;

/// Tracing is on (`COLOC_SHIM_TRACE` set, not empty, not `0`).
pub fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("COLOC_SHIM_TRACE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// (via, name, version, flags).
type Request = (String, Vec<u8>, c_int, u64);

/// Logs a request once: `via` (`dlsym` or the getter), the name, the version and flags
/// asked for (0 for `dlsym`), and whether the answer was our wrapper.
pub fn request(via: &str, name: &[u8], ver: c_int, flags: u64, wrapped: bool) {
    if !on() {
        return;
    }
    static SEEN: Mutex<Option<HashSet<Request>>> = Mutex::new(None);
    // try_lock: a fork child whose parent had the lock held by another thread would wait
    // for ever; without the lock a line may come twice.
    let count = match SEEN.try_lock() {
        Ok(mut seen) => {
            let seen = seen.get_or_insert_with(HashSet::new);
            if seen.len() > MAX || !seen.insert((via.to_string(), name.to_vec(), ver, flags)) {
                return;
            }
            seen.len()
        }
        Err(_) => 0,
    };
    // Written with the lock released: a slow stderr holds up only this thread.
    let line = if count > MAX {
        format!("libcoloc_cuda: trace: more than {MAX} distinct requests; no more logged\n")
    } else {
        format!(
            "libcoloc_cuda: trace: {via} {} ver={ver} flags={flags:#x} {}\n",
            String::from_utf8_lossy(name),
            if wrapped { "wrapped" } else { "passed" }
        )
    };
    // SAFETY: writing a valid buffer to fd 2; errors are ignored on purpose.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
    }
}
