//! glibc's own `dlsym` and `dlvsym`, and the next `dlsym` after this library.
//!
//! The shim interposes both `dlsym` and `dlvsym` ([`crate::hooks`]), so it can find
//! neither through the dynamic linker without finding itself. It reads them from the
//! dynamic symbol table of the loaded glibc instead: `libc.so.6` from glibc 2.34 on,
//! `libdl.so.2` before (2.17–2.33, where `dlsym` is `GLIBC_2.2.5` on x86_64 and
//! `GLIBC_2.17` on aarch64), musl's `libc.so` in a musl process (no `dlvsym` there).
//! Nothing here depends on a symbol version.
//!
//! **The next `dlsym`** ([`next_dlsym`]) is what `dlsym(RTLD_NEXT, "dlsym")` answers when
//! asked from this library: the next interposer's (another `LD_PRELOAD` or
//! `/etc/ld.so.preload` library that hooks `dlsym`, as HAMi-core does) or else glibc's.
//! Every `dlsym` call of the application's goes there (those the shim answers itself
//! too, for the pointer it wraps): an interposer loaded after the shim sees every lookup
//! it would see alone. The shim's own lookups ([`real_dlsym`]) use glibc's directly.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// glibc's `dlsym` (0: not found yet).
pub static GLIBC_DLSYM: AtomicUsize = AtomicUsize::new(0);
/// glibc's `dlvsym` (0: not found yet).
pub static GLIBC_DLVSYM: AtomicUsize = AtomicUsize::new(0);
/// The next `dlsym` after this library (0: not found yet).
pub static NEXT_DLSYM: AtomicUsize = AtomicUsize::new(0);
static NO_DLSYM: AtomicBool = AtomicBool::new(false);

/// Where `dlsym` and `dlvsym` are defined, by file name (prefixes end with `-`): glibc
/// from 2.34 on, glibc before, musl (Debian's and Alpine's names). A process of another C
/// library than glibc is not a CUDA process, but the shim must not break its `dlsym`.
const LIBCS: &[&[u8]] = &[
    b"libc.so.6",
    b"libdl.so.2",
    b"ld-musl-",
    b"libc.musl-",
    b"libc.so",
];

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Finds glibc's `dlsym` and `dlvsym` and the next `dlsym`, once; false (with one line on
/// stderr) when glibc's cannot be found.
pub fn resolve() -> bool {
    if NEXT_DLSYM.load(Acquire) != 0 {
        return true;
    }
    let find = |name: &[u8]| {
        LIBCS
            .iter()
            .map(|lib| elf::lookup(lib, name))
            .find(|&p| p != 0)
            .unwrap_or(0)
    };
    // musl has no dlvsym: only dlsym is required.
    let (dlsym, dlvsym) = (find(b"dlsym"), find(b"dlvsym"));
    if dlsym == 0 {
        crate::mode::warn_once(
            &NO_DLSYM,
            "cannot find the C library's dlsym; the shim is inactive",
        );
        return false;
    }
    GLIBC_DLVSYM.store(dlvsym, Release);
    GLIBC_DLSYM.store(dlsym, Release);
    // SAFETY: glibc's dlsym; called from this library, RTLD_NEXT starts after it.
    let next =
        unsafe { std::mem::transmute::<usize, DlsymFn>(dlsym)(libc::RTLD_NEXT, c"dlsym".as_ptr()) }
            as usize;
    NEXT_DLSYM.store(if next == 0 { dlsym } else { next }, Release);
    true
}

/// `dlsym(handle, name)` through glibc's own `dlsym`, from this library (`RTLD_NEXT`:
/// the next definition after it, another interposer's included). For the shim's own
/// lookups: the driver's functions, and the next definitions of its exported symbols.
/// Null when glibc's cannot be found.
pub fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    call(&GLIBC_DLSYM, handle, name)
}

/// `dlsym(handle, name)` through the next `dlsym` (see the module doc): for the lookups the
/// shim makes on the application's behalf, which an interposer after it must see too.
pub fn next_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    call(&NEXT_DLSYM, handle, name)
}

fn call(f: &AtomicUsize, handle: *mut c_void, name: &CStr) -> *mut c_void {
    if !resolve() {
        return std::ptr::null_mut();
    }
    // SAFETY: set by `resolve`: a dlsym (glibc's or an interposer's); a valid C string.
    unsafe { std::mem::transmute::<usize, DlsymFn>(f.load(Acquire))(handle, name.as_ptr()) }
}

/// Symbol lookup in a loaded ELF object's dynamic symbol table (64-bit objects).
mod elf {
    use super::*;

    const PT_DYNAMIC: u32 = 2;
    const DT_NULL: i64 = 0;
    const DT_HASH: i64 = 4;
    const DT_STRTAB: i64 = 5;
    const DT_SYMTAB: i64 = 6;
    const DT_GNU_HASH: i64 = 0x6fff_fef5;
    const DT_VERSYM: i64 = 0x6fff_fff0;
    const SHN_UNDEF: u16 = 0;
    const STT_FUNC: u8 = 2;

    #[repr(C)]
    struct Dyn {
        tag: i64,
        val: u64,
    }

    #[repr(C)]
    struct Sym {
        name: u32,
        info: u8,
        other: u8,
        shndx: u16,
        value: u64,
        size: u64,
    }

    struct Search<'a> {
        object: &'a [u8],
        name: &'a [u8],
        found: usize,
    }

    /// The address of function `name` defined in the loaded object whose file name is
    /// `object`, or starts with it where it ends with `-` (0: not loaded, or not defined
    /// there). Of several versions of the name,
    /// the default one.
    pub fn lookup(object: &[u8], name: &[u8]) -> usize {
        let mut s = Search {
            object,
            name,
            found: 0,
        };
        // SAFETY: dl_iterate_phdr with a callback that only reads the objects' mapped
        // headers and tables, and a pointer to `s` that outlives the call.
        unsafe { libc::dl_iterate_phdr(Some(each), (&mut s as *mut Search).cast()) };
        s.found
    }

    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _: usize, data: *mut c_void) -> c_int {
        // SAFETY: dl_iterate_phdr's contract: `info` is valid during the call; `data` is
        // our `Search`.
        let (info, s) = unsafe { (&*info, &mut *(data as *mut Search)) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a NUL-terminated path (empty for the main program).
        let path = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes();
        let file = path.rsplit(|&c| c == b'/').next().unwrap_or(path);
        let wanted = match s.object.strip_suffix(b"-") {
            Some(prefix) => file.starts_with(prefix),
            None => file == s.object,
        };
        if !wanted {
            return 0;
        }
        // SAFETY: the object's program headers, as the dynamic linker mapped them.
        s.found = unsafe { in_object(info, s.name) };
        1
    }

    /// # Safety
    /// `info` describes a loaded object.
    unsafe fn in_object(info: &libc::dl_phdr_info, name: &[u8]) -> usize {
        let base = info.dlpi_addr as usize;
        // SAFETY: `dlpi_phnum` headers at `dlpi_phdr` (the caller's contract).
        let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
        let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
            return 0;
        };
        let (mut strtab, mut symtab, mut gnu_hash, mut hash, mut versym) = (0, 0, 0, 0, 0);
        let mut d = (base + dynamic.p_vaddr as usize) as *const Dyn;
        // SAFETY: the object's dynamic section, ended by DT_NULL. Its addresses are
        // relocated in place by glibc on x86_64 and aarch64; a value below the base is an
        // offset and is relocated here.
        unsafe {
            while (*d).tag != DT_NULL {
                let v = (*d).val as usize;
                let v = if v < base { base + v } else { v };
                match (*d).tag {
                    DT_STRTAB => strtab = v,
                    DT_SYMTAB => symtab = v,
                    DT_GNU_HASH => gnu_hash = v,
                    DT_HASH => hash = v,
                    DT_VERSYM => versym = v,
                    _ => {}
                }
                d = d.add(1);
            }
        }
        if strtab == 0 || symtab == 0 {
            return 0;
        }
        let t = Tables {
            base,
            strtab,
            symtab: symtab as *const Sym,
            versym: versym as *const u16,
        };
        // SAFETY: the tables of a loaded object, read within their bounds as the hash
        // tables give them.
        unsafe {
            if gnu_hash != 0 {
                t.gnu(gnu_hash as *const u32, name)
            } else if hash != 0 {
                t.sysv(hash as *const u32, name)
            } else {
                0
            }
        }
    }

    struct Tables {
        base: usize,
        strtab: usize,
        symtab: *const Sym,
        versym: *const u16,
    }

    impl Tables {
        /// Symbol `i` if it is a function named `name` defined here: (address, default
        /// version).
        unsafe fn matches(&self, i: usize, name: &[u8]) -> Option<(usize, bool)> {
            // SAFETY: the caller's contract: `i` indexes the symbol table.
            let sym = unsafe { &*self.symtab.add(i) };
            if sym.shndx == SHN_UNDEF || sym.value == 0 || sym.info & 0xf != STT_FUNC {
                return None;
            }
            // SAFETY: a string table offset of this object's symbol.
            let n = unsafe { CStr::from_ptr((self.strtab + sym.name as usize) as *const c_char) };
            if n.to_bytes() != name {
                return None;
            }
            // SAFETY: DT_VERSYM has one entry per symbol.
            let default = self.versym.is_null() || unsafe { *self.versym.add(i) } & 0x8000 == 0;
            Some((self.base + sym.value as usize, default))
        }

        /// The default version's address among the matches (else any match's).
        fn pick(found: &mut usize, m: Option<(usize, bool)>) -> bool {
            match m {
                Some((a, true)) => {
                    *found = a;
                    true
                }
                Some((a, false)) if *found == 0 => {
                    *found = a;
                    false
                }
                _ => false,
            }
        }

        unsafe fn gnu(&self, h: *const u32, name: &[u8]) -> usize {
            // SAFETY (whole function): the GNU hash section's layout: nbuckets, symoffset,
            // bloom size, bloom shift, the bloom words (64-bit), the buckets, the chains.
            unsafe {
                let (nbuckets, symoffset, bloom) =
                    (*h as usize, *h.add(1) as usize, *h.add(2) as usize);
                if nbuckets == 0 {
                    return 0;
                }
                let buckets = h.add(4 + bloom * 2);
                let chains = buckets.add(nbuckets);
                let hash = name.iter().fold(5381u32, |h, &c| {
                    h.wrapping_mul(33).wrapping_add(u32::from(c))
                });
                let mut i = *buckets.add(hash as usize % nbuckets) as usize;
                if i < symoffset {
                    return 0;
                }
                let mut found = 0;
                loop {
                    let c = *chains.add(i - symoffset);
                    if (c | 1) == (hash | 1) && Self::pick(&mut found, self.matches(i, name)) {
                        return found;
                    }
                    if c & 1 != 0 {
                        return found;
                    }
                    i += 1;
                }
            }
        }

        unsafe fn sysv(&self, h: *const u32, name: &[u8]) -> usize {
            // SAFETY (whole function): the SysV hash section's layout: nbucket, nchain,
            // the buckets, the chains (one per symbol).
            unsafe {
                let nbucket = *h as usize;
                if nbucket == 0 {
                    return 0;
                }
                let buckets = h.add(2);
                let chains = buckets.add(nbucket);
                let hash = name.iter().fold(0u32, |mut h, &c| {
                    h = (h << 4).wrapping_add(u32::from(c));
                    let g = h & 0xf000_0000;
                    if g != 0 {
                        h ^= g >> 24;
                    }
                    h & !g
                });
                let mut i = *buckets.add(hash as usize % nbucket) as usize;
                let mut found = 0;
                while i != 0 {
                    if Self::pick(&mut found, self.matches(i, name)) {
                        return found;
                    }
                    i = *chains.add(i) as usize;
                }
                found
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn finds_libc_s_own_functions() {
            // `getpid` is not interposed by this crate: the program's reference resolves
            // to libc's.
            let getpid = lookup(b"libc.so.6", b"getpid");
            assert_eq!(getpid, libc::getpid as *const () as usize);
            assert_eq!(lookup(b"libc.so.6", b"no_such_function_here"), 0);
            assert_eq!(lookup(b"libnot-loaded.so.1", b"getpid"), 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_s_dlsym_is_found_and_is_not_ours() {
        assert!(resolve());
        // In this test program the crate's own `dlsym` is the one linked in.
        let ours = libc::dlsym as *const () as usize;
        let glibc = GLIBC_DLSYM.load(Acquire);
        assert!(glibc != 0 && glibc != ours);
        // glibc's dlsym answers like dlsym: it finds getpid in libc.
        // SAFETY: glibc's dlsym with a valid C string.
        let p = unsafe {
            std::mem::transmute::<usize, DlsymFn>(glibc)(libc::RTLD_DEFAULT, c"getpid".as_ptr())
        };
        assert_eq!(p as usize, libc::getpid as *const () as usize);
        assert_ne!(GLIBC_DLVSYM.load(Acquire), 0);
        assert_ne!(NEXT_DLSYM.load(Acquire), ours);
    }
}
