//! One packet interface over XDP and TC, so the load balancer is written once. Every access is
//! by offset and bounds-checked again, because TC helpers invalidate earlier packet pointers.
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
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
    /// Not this program's: the next one on the hook decides (TC), or the stack (XDP).
    Next,
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

    /// A pointer to `size_of::<T>()` bytes at `off`, checked once: accesses through it need no
    /// further checks, until a helper call that may move the packet.
    #[inline(always)]
    fn ptr<T>(&self, off: usize) -> Option<*mut T> {
        let start = self.data();
        if start + off + core::mem::size_of::<T>() > self.data_end() {
            return None;
        }
        Some((start + off) as *mut T)
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

    /// L4 checksum update for a rewrite: `addr_diff` covers pseudo-header fields (addresses),
    /// `port_diff` fields of the L4 header itself (ports), both as `csum::diff*` sums.
    fn l4_csum_update(&mut self, c: L4Csum, addr_diff: u32, port_diff: u32) -> Option<()>;
    /// Grow or shrink the packet to exactly `len` bytes at the tail.
    fn resize(&mut self, len: usize) -> Option<()>;
    /// Set the skb mark (IPVS mode's masquerade bit). XDP has no mark.
    fn or_mark(&mut self, mark: u32);
    /// Adds `diff` to the skb's CHECKSUM_COMPLETE sum (bytes the sum covers changed with no
    /// checksum field to cancel them: IPv6 addresses). Nothing for other skbs and for XDP.
    fn complete_csum_add(&mut self, _diff: u32) {}
    /// The interface the hook runs on (TC egress: the one the packet leaves by).
    fn ifindex(&self) -> u32;
    /// How a generated reply leaves: `Bounce` straight back out of the interface (MACs
    /// swapped), or `Pass` to the node's stack, which routes it back (MACs kept).
    fn reply_verdict(&self) -> Verdict;
}

pub struct Xdp<'a>(pub &'a XdpContext);

/// A complete L4 checksum after a change. A zero UDP checksum means "none" and stays zero.
#[inline(always)]
fn update_full<P: Pkt>(p: &mut P, c: L4Csum, diff: u32) -> Option<()> {
    let old: u16 = p.load(c.off)?;
    if c.udp && old == 0 {
        return Some(());
    }
    p.store(c.off, csum::apply_l4(old, diff, c.udp))
}

impl Xdp<'_> {
    pub fn action(v: Verdict) -> u32 {
        match v {
            Verdict::Pass | Verdict::Next => xdp_action::XDP_PASS,
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
    // No skb yet: the checksum is in the frame and nowhere else.
    #[inline(always)]
    fn l4_csum_update(&mut self, c: L4Csum, addr_diff: u32, port_diff: u32) -> Option<()> {
        update_full(self, c, addr_diff + port_diff)
    }
    #[inline(always)]
    fn resize(&mut self, len: usize) -> Option<()> {
        let delta = len as i32 - self.len() as i32;
        let rc = unsafe { bpf_xdp_adjust_tail(self.0.ctx, delta) };
        (rc == 0).then_some(())
    }
    #[inline(always)]
    fn or_mark(&mut self, _mark: u32) {}
    #[inline(always)]
    fn ifindex(&self) -> u32 {
        unsafe { (*self.0.ctx).ingress_ifindex }
    }
    // Straight back out of the NIC (XDP_TX): handed to the stack instead, the reject would be
    // forwarded through netfilter, whose conntrack knows no flow it is about (the packet it
    // answers never got there) and calls it INVALID, so kube-proxy's INVALID drop rule and
    // every CNI's would eat it. A veth uplink needs its peer to have NAPI (GRO on, or an XDP
    // program), as a NIC always does.
    #[inline(always)]
    fn reply_verdict(&self) -> Verdict {
        Verdict::Bounce
    }
}

pub struct Tc<'a>(pub &'a mut TcContext);

/// Ethernet + the largest IPv4 header + a TCP header without options; also covers an ICMP
/// error's quote up to the quoted TCP checksum (14 + 20 + 8 + 20 + 18).
const HEADERS_MAX: u32 = 14 + 60 + 20;
/// IPv6: an ICMPv6 error's quote up to the quoted TCP checksum (14 + 40 + 8 + 40 + 18), which
/// also covers TCP behind 40 bytes of extension headers. Drivers that keep only the headers
/// they parsed linear (eth_get_headlen) leave a quote in paged data.
pub const HEADERS6_MAX: u32 = 14 + 40 + 8 + 40 + 20;

impl Tc<'_> {
    /// Makes the headers directly accessible when the skb keeps them in paged data.
    #[inline(always)]
    pub fn pull_headers(&mut self) {
        self.pull_headers_to(HEADERS_MAX);
    }

    /// `pull_headers` up to `max` bytes (IPv6: HEADERS6_MAX).
    #[inline(always)]
    pub fn pull_headers_to(&mut self, max: u32) {
        let len = unsafe { (*self.0.skb.skb).len };
        let want = if len < max { len } else { max };
        if (self.len() as u32) < want {
            let _ = self.0.pull_data(want);
        }
    }

    /// bpf_l4_csum_replace with a precomputed difference (size 0).
    #[inline(always)]
    fn l4_replace_diff(&mut self, c: L4Csum, diff: u32, pseudo: bool) -> Option<()> {
        let mut flags = if c.udp { BPF_F_MARK_MANGLED_0 } else { 0 };
        if pseudo {
            flags |= BPF_F_PSEUDO_HDR;
        }
        self.0.l4_csum_replace(c.off, 0, u64::from(diff), flags).ok()
    }

    pub fn action(&self, v: Verdict) -> i32 {
        match v {
            Verdict::Pass => TC_ACT_OK as i32,
            Verdict::Next => TC_ACT_UNSPEC as i32,
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
    /// The skb's checksum state decides the update, and only the kernel sees it: a
    /// CHECKSUM_PARTIAL packet (a local sender's, the usual case on a pod's veth) holds the
    /// pseudo-header sum, which address changes move up and port changes leave alone; any other
    /// holds the full checksum, which both move down (and CHECKSUM_COMPLETE also needs
    /// skb->csum fixed). One helper call applies the addresses; the direction the field moved
    /// tells the state, and the ports are then applied by hand. A helper call costs ~20 ns on
    /// CPUs with return-thunk mitigations, the rest of this path about as much.
    #[inline(always)]
    fn l4_csum_update(&mut self, c: L4Csum, addr_diff: u32, port_diff: u32) -> Option<()> {
        let old: u16 = self.load(c.off)?;
        // UDP without a checksum (never the case with CHECKSUM_PARTIAL, whose field is a
        // non-zero pseudo-header sum): nothing to update.
        if c.udp && old == 0 {
            return Some(());
        }
        if csum::is_zero(addr_diff) {
            // Moves neither way: the state stays unknown, so the ports go through the kernel too.
            return if csum::is_zero(port_diff) { Some(()) } else { self.l4_replace_diff(c, port_diff, false) };
        }
        self.l4_replace_diff(c, addr_diff, true)?;
        if csum::is_zero(port_diff) {
            return Some(());
        }
        // The helper may have moved the packet: one new check, then read and write through it.
        let field = self.ptr::<u16>(c.off)?;
        let now = unsafe { *field };
        if csum::same(now, csum::apply(old, addr_diff)) {
            // A full checksum: the port change cancels its own in skb->csum, so only the field.
            // (A UDP zero here would have been left alone by the helper: `old` was not zero.)
            unsafe { *field = csum::apply_l4(now, port_diff, c.udp) };
            Some(())
        } else if csum::same(now, csum::add(old, addr_diff)) {
            // CHECKSUM_PARTIAL: the device (or skb_checksum_help) sums the new ports itself.
            Some(())
        } else {
            self.l4_replace_diff(c, port_diff, false)
        }
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
    fn complete_csum_add(&mut self, diff: u32) {
        // Fails (harmlessly) unless the skb is CHECKSUM_COMPLETE.
        let _ = unsafe { aya_ebpf::helpers::bpf_csum_update(self.0.skb.skb, diff) };
    }
    #[inline(always)]
    fn ifindex(&self) -> u32 {
        unsafe { (*self.0.skb.skb).ifindex }
    }
    #[inline(always)]
    fn reply_verdict(&self) -> Verdict {
        Verdict::Bounce
    }
}
