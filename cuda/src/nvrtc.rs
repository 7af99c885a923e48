//! NVRTC: finding the library, compiling emitted CUDA source to a cubin for one architecture,
//! and caching the result in memory and on disk (keyed by a hash of the source, the `-D`
//! defines, the architecture and the NVRTC version), so that the second run of a program
//! compiles nothing.
//!
//! Where the library comes from: `ATTNC_NVRTC_LIB` (the `libnvrtc.so.12` file, or its
//! directory), else the folder `.ci/run` installs the `nvidia-cuda-nvrtc-cu12` wheel into
//! (`$HOME/.cache/attnc/nvrtc`), else the dynamic loader's normal search (`LD_LIBRARY_PATH`, a
//! CUDA toolkit). A library found by path is loaded first so that cudarc's by-name lookup finds
//! it already loaded; nothing calls into NVRTC before [`available`] has succeeded.

use cudarc::nvrtc::{result, sys};
use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The library file name on Linux.
const LIB_NAME: &str = "libnvrtc.so.12";

/// Candidate paths for NVRTC before the loader's own search.
pub fn candidate_paths() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("ATTNC_NVRTC_LIB") {
        let p = PathBuf::from(p);
        out.push(if p.is_dir() { p.join(LIB_NAME) } else { p });
    }
    if let Some(home) = std::env::var_os("HOME") {
        out.push(Path::new(&home).join(".cache/attnc/nvrtc/nvidia/cuda_nvrtc/lib").join(LIB_NAME));
    }
    out
}

/// Loads NVRTC once per process: `Ok(path or "system")`, or why not.
pub fn available() -> Result<String, String> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let mut tried = Vec::new();
            for path in candidate_paths() {
                if !path.is_file() {
                    tried.push(path.display().to_string());
                    continue;
                }
                // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
                // The library stays loaded for the life of the process (cudarc holds it too).
                match unsafe { libloading::Library::new(&path) } {
                    Ok(lib) => {
                        std::mem::forget(lib);
                        break;
                    }
                    Err(e) => tried.push(format!("{} ({e})", path.display())),
                }
            }
            // SAFETY: only probes whether the library can be opened by its standard names.
            if unsafe { sys::is_culib_present() } {
                Ok(candidate_paths().into_iter().find(|p| p.is_file()).map_or_else(|| "system".to_string(), |p| p.display().to_string()))
            } else {
                Err(format!(
                    "NVRTC ({LIB_NAME}) was not found (looked in {}, then LD_LIBRARY_PATH); install it with `python3 -m pip install --target $HOME/.cache/attnc/nvrtc nvidia-cuda-nvrtc-cu12` or set ATTNC_NVRTC_LIB",
                    if tried.is_empty() { "no extra places".to_string() } else { tried.join(", ") }
                ))
            }
        })
        .clone()
}

/// NVRTC's version, `(major, minor)`. Call only after [`available`] succeeded.
pub fn version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked by the caller); both pointers are valid for writes.
    unsafe {
        let _ = sys::nvrtcVersion(&mut major, &mut minor);
    }
    (major, minor)
}

/// A compiled module image and what the compiler said.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The cubin (for `--gpu-architecture=sm_XY`).
    pub image: Arc<Vec<u8>>,
    /// The compile log (ptxas register and spill report when asked for).
    pub log: String,
}

/// Compiles `source` for `arch` (`sm_80`, `sm_90`, ...) with `-D` defines and extra options.
/// `Err` holds the compiler log. Call only after [`available`] succeeded.
pub fn compile(source: &str, arch: &str, defines: &[(String, i64)], extra: &[&str]) -> Result<Compiled, String> {
    let src = CString::new(source).map_err(|_| "the source contains a NUL byte".to_string())?;
    let name = CString::new("attnc.cu").map_err(|e| e.to_string())?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("nvrtcCreateProgram: {e}"))?;
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    options.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: `prog` was created above and is destroyed exactly once below.
    let compiled = unsafe { result::compile_program(prog, &options) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }.map(|chars| c_chars_to_string(&chars)).unwrap_or_default();
    let out = match compiled {
        Ok(()) => cubin(prog).map(|image| Compiled { image: Arc::new(image), log }),
        Err(e) => Err(format!("{e}\n{log}")),
    };
    // SAFETY: as above; the program is not used afterwards.
    unsafe {
        let _ = result::destroy_program(prog);
    }
    out
}

fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `prog` is a successfully compiled program; the buffer has the size NVRTC reports.
    unsafe {
        sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| format!("nvrtcGetCUBINSize: {e}"))?;
        let mut image = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()).result().map_err(|e| format!("nvrtcGetCUBIN: {e}"))?;
        Ok(image)
    }
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    // `c_char` is `i8` on x86-64 and `u8` on AArch64: the byte either way.
    let bytes: Vec<u8> = chars.iter().take_while(|c| **c != 0).map(|c| u8::from_ne_bytes(c.to_ne_bytes())).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// 128-bit FNV-1a: a stable content hash for cache keys (std's hashers are not stable across
/// Rust versions, and a collision here would only cost a wrong cache hit on identical length
/// and 128-bit hash).
pub fn content_hash(parts: &[&[u8]]) -> u128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h = OFFSET;
    for part in parts {
        for b in part.iter().chain(&(part.len() as u64).to_le_bytes()) {
            h ^= u128::from(*b);
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// Compiled images by content, in memory and (best effort) on disk.
pub struct Cache {
    memory: Mutex<HashMap<u128, Arc<Vec<u8>>>>,
    dir: Option<PathBuf>,
    compiles: AtomicUsize,
}

impl Cache {
    /// A cache in `ATTNC_CACHE_DIR`, else `$XDG_CACHE_HOME/attnc/cuda`, else
    /// `$HOME/.cache/attnc/cuda` (no disk cache when none is set).
    pub fn new() -> Cache {
        let dir = std::env::var_os("ATTNC_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| Path::new(&d).join("attnc/cuda")))
            .or_else(|| std::env::var_os("HOME").map(|d| Path::new(&d).join(".cache/attnc/cuda")));
        Cache { memory: Mutex::new(HashMap::new()), dir, compiles: AtomicUsize::new(0) }
    }

    /// A cache with no disk directory (tests).
    pub fn in_memory() -> Cache {
        Cache { memory: Mutex::new(HashMap::new()), dir: None, compiles: AtomicUsize::new(0) }
    }

    /// How many sources this cache has compiled (misses in memory and on disk).
    pub fn compiles(&self) -> usize {
        self.compiles.load(Ordering::Relaxed)
    }

    /// The image for this source, arch and defines: from memory, from disk, or compiled now.
    /// Returns the image and whether it was compiled by this call.
    pub fn get(&self, source: &str, arch: &str, defines: &[(String, i64)]) -> Result<(Arc<Vec<u8>>, bool), String> {
        let (major, minor) = version();
        let defs: String = defines.iter().map(|(k, v)| format!("-D{k}={v};")).collect();
        let nv = format!("nvrtc {major}.{minor}");
        // ATTNC_NVRTC_OPTIONS: extra compiler options, whitespace-separated (for experiments,
        // e.g. `--maxrregcount=168`); part of the cache key.
        let extra_text = std::env::var("ATTNC_NVRTC_OPTIONS").unwrap_or_default();
        let extra: Vec<&str> = extra_text.split_whitespace().collect();
        let key = content_hash(&[source.as_bytes(), arch.as_bytes(), defs.as_bytes(), nv.as_bytes(), extra.join(" ").as_bytes()]);
        if let Some(img) = self.memory.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok((img, false));
        }
        let file = self.dir.as_ref().map(|d| d.join(format!("{key:032x}.cubin")));
        if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()).filter(|b| !b.is_empty()) {
            let img = Arc::new(bytes);
            if let Ok(mut m) = self.memory.lock() {
                m.insert(key, img.clone());
            }
            return Ok((img, false));
        }
        let compiled = compile(source, arch, defines, &extra)?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        if let (Some(dir), Some(file)) = (&self.dir, &file) {
            // Write then rename, so a concurrent reader never sees half a file; failures only
            // cost a recompile next time.
            let tmp = dir.join(format!("{key:032x}.{}.tmp", std::process::id()));
            if std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, compiled.image.as_slice()).is_ok() {
                let _ = std::fs::rename(&tmp, file);
            }
        }
        if let Ok(mut m) = self.memory.lock() {
            m.insert(key, compiled.image.clone());
        }
        Ok((compiled.image, true))
    }
}

impl Default for Cache {
    fn default() -> Self {
        Cache::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_separates_parts() {
        assert_eq!(content_hash(&[b"abc"]), content_hash(&[b"abc"]));
        assert_ne!(content_hash(&[b"ab", b"c"]), content_hash(&[b"a", b"bc"]));
        assert_ne!(content_hash(&[b"sm_80"]), content_hash(&[b"sm_90"]));
        // A fixed value (FNV-1a 128 of the bytes and their length): the on-disk cache names
        // must not change between builds or Rust versions.
        assert_eq!(format!("{:032x}", content_hash(&[b"attnc"])), "956dc9858101e748be216368be09e452");
    }
}
