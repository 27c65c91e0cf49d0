//! One packet interface over XDP and TC, so the load balancer is written once. Every access is
//! by offset and bounds-checked again, because TC helpers invalidate earlier packet pointers.
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_redirect, bpf_skb_change_tail, bpf_xdp_adjust_tail},
    programs::{TcContext, XdpContext},
};
use aya_ebpf::bindings::xdp_action;

use crate::csum;

const BPF_F_PSEUDO_HDR: u64 = 0x10;
const BPF_F_MARK_MANGLED_0: u64 = 0x20;

/// What to do with the packet, hook-independent.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    /// Send back out of the interface it arrived on (a generated reject).
    Bounce,
}

/// Where an L4 checksum lives and what it covers.
#[derive(Clone, Copy)]
pub struct L4Csum {
    pub off: usize,
    /// UDP: a zero checksum means "none" and must stay zero.
    pub udp: bool,
}

pub trait Pkt {
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;

    /// Bytes directly accessible (the linear part for an skb).
    #[inline(always)]
    fn len(&self) -> usize {
        self.data_end() - self.data()
    }

    /// The whole packet's length, paged data included.
    fn wire_len(&self) -> usize;

    #[inline(always)]
    fn load<T: Copy>(&self, off: usize) -> Option<T> {
        let start = self.data();
        let size = core::mem::size_of::<T>();
        if start + off + size > self.data_end() {
            return None;
        }
        // Packet access need not be aligned on the BPF targets we load on; a typed (not
        // byte-wise unaligned) access keeps LLVM from spilling every byte to the 512-byte stack.
        Some(unsafe { core::ptr::read((start + off) as *const T) })
    }

    #[inline(always)]
    fn store<T: Copy>(&mut self, off: usize, v: T) -> Option<()> {
        let start = self.data();
        let size = core::mem::size_of::<T>();
        if start + off + size > self.data_end() {
            return None;
        }
        unsafe { core::ptr::write((start + off) as *mut T, v) };
        Some(())
    }

    /// IPv4 header checksum update for a 32-bit field change.
    fn l3_csum4(&mut self, csum_off: usize, from: u32, to: u32) -> Option<()>;
    /// L4 checksum update; `pseudo` when the field is part of the pseudo header (addresses).
    fn l4_csum4(&mut self, c: L4Csum, from: u32, to: u32, pseudo: bool) -> Option<()>;
    fn l4_csum2(&mut self, c: L4Csum, from: u16, to: u16) -> Option<()>;
    /// Grow or shrink the packet to exactly `len` bytes at the tail.
    fn resize(&mut self, len: usize) -> Option<()>;
    /// Set the skb mark (kube-proxy's masquerade bit). XDP has no mark.
    fn or_mark(&mut self, mark: u32);
    /// How a generated reply leaves: `Bounce` straight back out of the interface (MACs
    /// swapped), or `Pass` to the node's stack, which routes it back (MACs kept).
    fn reply_verdict(&self) -> Verdict;
}

pub struct Xdp<'a>(pub &'a XdpContext);

impl Xdp<'_> {
    #[inline(always)]
    fn update_csum(&mut self, off: usize, f: impl FnOnce(u16) -> u16, udp: bool) -> Option<()> {
        let old: u16 = self.load(off)?;
        if udp && old == 0 {
            return Some(());
        }
        let mut new = f(old);
        if udp && new == 0 {
            new = 0xffff;
        }
        self.store(off, new)
    }

    pub fn action(v: Verdict) -> u32 {
        match v {
            Verdict::Pass => xdp_action::XDP_PASS,
            Verdict::Drop => xdp_action::XDP_DROP,
            Verdict::Bounce => xdp_action::XDP_TX,
        }
    }
}

impl Pkt for Xdp<'_> {
    #[inline(always)]
    fn wire_len(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    // Volatile: otherwise LLVM proves one bounds check from another (via data_end - data)
    // and drops checks the verifier needs at each access.
    #[inline(always)]
    fn data_end(&self) -> usize {
        unsafe { core::ptr::read_volatile(&(*self.0.ctx).data_end) as usize }
    }
    #[inline(always)]
    fn l3_csum4(&mut self, csum_off: usize, from: u32, to: u32) -> Option<()> {
        self.update_csum(csum_off, |c| csum::replace4(c, from, to), false)
    }
    #[inline(always)]
    fn l4_csum4(&mut self, c: L4Csum, from: u32, to: u32, _pseudo: bool) -> Option<()> {
        self.update_csum(c.off, |v| csum::replace4(v, from, to), c.udp)
    }
    #[inline(always)]
    fn l4_csum2(&mut self, c: L4Csum, from: u16, to: u16) -> Option<()> {
        self.update_csum(c.off, |v| csum::replace2(v, from, to), c.udp)
    }
    #[inline(always)]
    fn resize(&mut self, len: usize) -> Option<()> {
        let delta = len as i32 - self.len() as i32;
        let rc = unsafe { bpf_xdp_adjust_tail(self.0.ctx, delta) };
        (rc == 0).then_some(())
    }
    #[inline(always)]
    fn or_mark(&mut self, _mark: u32) {}
    // XDP_TX needs the peer to accept XDP frames (a veth peer only does with NAPI on); the
    // stack's forwarding path works on every driver, and rejects are not the fast path.
    #[inline(always)]
    fn reply_verdict(&self) -> Verdict {
        Verdict::Pass
    }
}

pub struct Tc<'a>(pub &'a mut TcContext);

/// Ethernet + the largest IPv4 header + a TCP header without options.
const HEADERS_MAX: u32 = 14 + 60 + 20;

impl Tc<'_> {
    /// Makes the headers directly accessible when the skb keeps them in paged data.
    #[inline(always)]
    pub fn pull_headers(&mut self) {
        let len = unsafe { (*self.0.skb.skb).len };
        let want = if len < HEADERS_MAX { len } else { HEADERS_MAX };
        if (self.len() as u32) < want {
            let _ = self.0.pull_data(want);
        }
    }

    #[inline(always)]
    fn flags(c: L4Csum) -> u64 {
        if c.udp {
            BPF_F_MARK_MANGLED_0
        } else {
            0
        }
    }

    pub fn action(&self, v: Verdict) -> i32 {
        match v {
            Verdict::Pass => TC_ACT_OK as i32,
            Verdict::Drop => TC_ACT_SHOT as i32,
            // Out of the same device: a reject goes back to the sender.
            Verdict::Bounce => unsafe { bpf_redirect((*self.0.skb.skb).ifindex, 0) as i32 },
        }
    }
}

impl Pkt for Tc<'_> {
    #[inline(always)]
    fn wire_len(&self) -> usize {
        unsafe { (*self.0.skb.skb).len as usize }
    }
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        unsafe { core::ptr::read_volatile(&(*self.0.skb.skb).data_end) as usize }
    }
    #[inline(always)]
    fn l3_csum4(&mut self, csum_off: usize, from: u32, to: u32) -> Option<()> {
        self.0.l3_csum_replace(csum_off, u64::from(from), u64::from(to), 4).ok()
    }
    // The kernel helpers know the skb's checksum state (CHECKSUM_PARTIAL from local senders),
    // which hand arithmetic cannot see.
    #[inline(always)]
    fn l4_csum4(&mut self, c: L4Csum, from: u32, to: u32, pseudo: bool) -> Option<()> {
        let pseudo = if pseudo { BPF_F_PSEUDO_HDR } else { 0 };
        self.0
            .l4_csum_replace(c.off, u64::from(from), u64::from(to), 4 | pseudo | Self::flags(c))
            .ok()
    }
    #[inline(always)]
    fn l4_csum2(&mut self, c: L4Csum, from: u16, to: u16) -> Option<()> {
        self.0
            .l4_csum_replace(c.off, u64::from(from), u64::from(to), 2 | Self::flags(c))
            .ok()
    }
    #[inline(always)]
    fn resize(&mut self, len: usize) -> Option<()> {
        let rc = unsafe { bpf_skb_change_tail(self.0.skb.skb, len as u32, 0) };
        (rc == 0).then_some(())
    }
    #[inline(always)]
    fn or_mark(&mut self, mark: u32) {
        unsafe { (*self.0.skb.skb).mark |= mark };
    }
    #[inline(always)]
    fn reply_verdict(&self) -> Verdict {
        Verdict::Bounce
    }
}
