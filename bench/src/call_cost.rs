//! What a call costs a BPF program on this machine: a BPF-to-BPF call and its return, and a
//! helper call, each measured against the same program without the calls. A new flow makes
//! tens of calls, so a CPU whose every return goes through a mitigation's thunk (AMD's SRSO
//! "Safe RET", retbleed's untrained return) pays for them in the new-flow rows. Raw instructions
//! loaded with bpf(2): the figures depend on the kernel's JIT, not on the project's programs.
use std::{ffi::CString, os::fd::FromRawFd, os::fd::OwnedFd};

use proxy_agent::dataplane::ebpf::bpf_batch::bpf;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_FUNC_GET_PRANDOM_U32: i32 = 7;
const BPF_PSEUDO_CALL: u8 = 1;
/// Calls in each measured program: enough for the calls to dwarf the program's entry.
const CALLS: usize = 64;

/// One eBPF instruction.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, imm: i32) -> Insn {
    Insn { code, regs: (src << 4) | dst, off: 0, imm }
}
const MOV64_IMM: u8 = 0xb7;
const ADD64_IMM: u8 = 0x07;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
/// `return 0`: the end of each program, and the BPF-to-BPF calls' callee.
const RETURN_0: [Insn; 2] = [insn(MOV64_IMM, 0, 0, 0), insn(EXIT, 0, 0, 0)];

/// `union bpf_attr`'s BPF_PROG_LOAD member, as far as it is used.
#[repr(C)]
#[derive(Default)]
struct LoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
}

/// `union bpf_attr`'s BPF_PROG_TEST_RUN member, as far as it is used.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
}

/// `body`, then `return 0`, then `tail` (where BPF-to-BPF calls land).
fn load(body: &[Insn], tail: &[Insn]) -> std::io::Result<OwnedFd> {
    let mut insns = body.to_vec();
    insns.extend(RETURN_0);
    insns.extend_from_slice(tail);
    let license = CString::new("GPL").expect("no NUL");
    let mut attr = LoadAttr {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        ..Default::default()
    };
    let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// ns a run, the kernel's figure (the best of five, `repeat` runs each).
fn time(prog: &OwnedFd, repeat: u32) -> std::io::Result<f64> {
    use std::os::fd::AsRawFd;
    let frame = [0u8; 64];
    let mut best = u32::MAX;
    for _ in 0..5 {
        let mut attr =
            TestRunAttr { prog_fd: prog.as_raw_fd() as u32, data_size_in: frame.len() as u32, data_in: frame.as_ptr() as u64, repeat, ..Default::default() };
        bpf(BPF_PROG_TEST_RUN, &mut attr)?;
        best = best.min(attr.duration);
    }
    Ok(f64::from(best))
}

/// ns a call: (BPF-to-BPF call and return, bpf_get_prandom_u32).
pub fn measure(repeat: u32) -> std::io::Result<(f64, f64)> {
    let plain: Vec<Insn> = (0..CALLS).map(|_| insn(ADD64_IMM, 1, 0, 1)).collect();
    let helper: Vec<Insn> = (0..CALLS).map(|_| insn(CALL, 0, 0, BPF_FUNC_GET_PRANDOM_U32)).collect();
    // A pseudo call's imm is the callee's offset from the next instruction; the callee sits
    // after the body's `return 0`.
    let local: Vec<Insn> = (0..CALLS).map(|i| insn(CALL, 0, BPF_PSEUDO_CALL, (CALLS + RETURN_0.len() - (i + 1)) as i32)).collect();
    let floor = time(&load(&plain, &[])?, repeat)?;
    let local = time(&load(&local, &RETURN_0)?, repeat)?;
    let helper = time(&load(&helper, &[])?, repeat)?;
    let each = |t: f64| ((t - floor) / CALLS as f64).max(0.0);
    Ok((each(local), each(helper)))
}

/// This CPU's return-mitigation line, as the kernel reports it ("" if none is reported).
pub fn return_mitigations() -> String {
    ["spec_rstack_overflow", "retbleed"]
        .iter()
        .filter_map(|v| {
            let s = std::fs::read_to_string(format!("/sys/devices/system/cpu/vulnerabilities/{v}")).ok()?;
            Some(format!("{v}: {}", s.trim()))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    /// The three programs pass the running kernel's verifier and run (root); no figure is
    /// asserted, timing is the benchmark's business.
    #[test]
    fn the_call_programs_load_and_run() {
        let (local, helper) = super::measure(1_000).expect("load and run the call programs");
        assert!(local.is_finite() && helper.is_finite(), "{local} {helper}");
    }
}
