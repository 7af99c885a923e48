//! JIT compilation of a [`CpuModule`]'s functions with cranelift-jit: host ISA flags from
//! cranelift-native, `opt_level = speed`, and the microkernel and helper symbols registered so
//! generated calls resolve to them.

use crate::CpuError;
use crate::abi;
use crate::render::{CpuModule, Features};
use cranelift_codegen::ir::{ExternalName, UserExternalName};
use cranelift_codegen::isa::OwnedTargetIsa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{FuncId, Linkage, Module, default_libcall_names};
use std::collections::HashMap;

/// The signature of every step function (see [`abi::step_signature`]).
pub type StepFn = unsafe extern "C" fn(bufs: *const *mut u8, ints: *const i64, lo: i64, hi: i64, scratch: *mut u8);

/// Builds the host ISA: native feature flags, optimisation for speed.
pub fn host_isa() -> Result<OwnedTargetIsa, CpuError> {
    let mut flags = settings::builder();
    for (name, value) in [("opt_level", "speed"), ("use_colocated_libcalls", "false"), ("is_pic", "false")] {
        flags.set(name, value).map_err(|e| CpuError::Jit(format!("setting {name}={value}: {e}")))?;
    }
    let builder = cranelift_native::builder().map_err(|e| CpuError::Jit(format!("this host is not supported: {e}")))?;
    builder.finish(settings::Flags::new(flags)).map_err(|e| CpuError::Jit(format!("building the host ISA: {e}")))
}

/// Executable code for one module: the step functions, kept alive with their memory.
pub struct Code {
    module: Option<JITModule>,
    /// One entry point per function of the module, in order.
    pub funcs: Vec<StepFn>,
}

// SAFETY: after `finalize_definitions` the module is never used again except to free its
// memory in `Drop` (which has exclusive access); the function pointers are plain code addresses
// that any thread may call.
unsafe impl Send for Code {}
// SAFETY: as above: no `&self` method touches the module.
unsafe impl Sync for Code {}

impl Drop for Code {
    fn drop(&mut self) {
        if let Some(m) = self.module.take() {
            // SAFETY: `Code` owns the only copies of the function pointers; they die with it.
            unsafe { m.free_memory() };
        }
    }
}

/// What generated code may assume on this host: its calling convention.
pub fn features(isa: &OwnedTargetIsa) -> Features {
    Features { call_conv: isa.default_call_conv() }
}

/// Compiles every function of `m` to machine code.
pub fn load(isa: OwnedTargetIsa, m: &CpuModule) -> Result<Code, CpuError> {
    let call_conv = isa.default_call_conv();
    let mut builder = JITBuilder::with_isa(isa, default_libcall_names());
    for i in abi::IMPORTS {
        builder.symbol(i.name, i.address());
    }
    let mut module = JITModule::new(builder);
    let jit_err = |what: &str, e: &dyn std::fmt::Display| CpuError::Jit(format!("{what}: {e}"));
    let mut imports: HashMap<&str, FuncId> = HashMap::new();
    for i in abi::IMPORTS {
        let id = module.declare_function(i.name, Linkage::Import, &i.signature(call_conv)).map_err(|e| jit_err(i.name, &e))?;
        imports.insert(i.name, id);
    }
    let mut ctx = module.make_context();
    let mut ids = Vec::with_capacity(m.functions.len());
    for (n, f) in m.functions.iter().enumerate() {
        let mut func = f.clone();
        // Point each symbol the function calls at the module's declaration of it.
        let refs: Vec<_> = func.dfg.ext_funcs.keys().collect();
        for r in refs {
            let name = match &func.dfg.ext_funcs[r].name {
                ExternalName::TestCase(t) => String::from_utf8_lossy(t.raw()).into_owned(),
                _ => continue,
            };
            let id = imports.get(name.as_str()).ok_or_else(|| CpuError::Jit(format!("unknown symbol `{name}`")))?;
            let user = func.declare_imported_user_function(UserExternalName { namespace: 0, index: id.as_u32() });
            func.dfg.ext_funcs[r].name = ExternalName::user(user);
        }
        let id = module
            .declare_function(&format!("attnc_step_{n}"), Linkage::Local, &func.signature)
            .map_err(|e| jit_err("declaring a step", &e))?;
        ctx.func = func;
        // `ATTNC_DUMP_VCODE=1` prints the machine code of every step (for profiling).
        let dump = std::env::var_os("ATTNC_DUMP_VCODE").is_some();
        ctx.set_disasm(dump);
        module.define_function(id, &mut ctx).map_err(|e| CpuError::Jit(format!("compiling step {n}: {e:?}")))?;
        if let Some(code) = ctx.compiled_code().filter(|_| dump).and_then(|c| c.vcode.as_ref()) {
            eprintln!("; step {n}\n{code}");
        }
        module.clear_context(&mut ctx);
        ids.push(id);
    }
    module.finalize_definitions().map_err(|e| jit_err("finalizing", &e))?;
    let funcs = ids
        .iter()
        .map(|id| {
            let ptr = module.get_finalized_function(*id);
            // SAFETY: the function was generated with `abi::step_signature` under the host's
            // default calling convention, which is `StepFn`'s `extern "C"` ABI.
            unsafe { std::mem::transmute::<*const u8, StepFn>(ptr) }
        })
        .collect();
    Ok(Code { module: Some(module), funcs })
}
