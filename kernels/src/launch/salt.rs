//! The micro-batches' dropout salts in device memory: a draw's key is the constant its launch
//! carries XOR its micro-batch's salt ([`crate::dropout::salted`]), so a launch recorded in a
//! captured graph draws the masks of whichever micro-batch's salt is written here before the
//! replay, while the eager step writes one when a launch needs another micro-batch's. One
//! buffer per micro-batch of the step (its slot): a step of several micro-batches is captured
//! whole, each micro-batch's launches reading their own slot.

use std::cell::RefCell;
use std::collections::HashMap;

use cubecl::bytes::Bytes;
use cubecl::device::DeviceId;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arg;
use super::dropout::DropoutDraw;

thread_local! {
    /// Per device this thread launches on and micro-batch slot: the salt's buffer (two `u32`,
    /// low word first) and the value last written to it. Per thread because each thread has
    /// its own CubeCL stream (ranks as threads of one process each draw their own
    /// micro-batches), and a write is ordered only on its own stream.
    static SALTS: RefCell<HashMap<(DeviceId, u64), (Handle, u64)>> = RefCell::new(HashMap::new());
}

/// The buffer of micro-batch slot `slot` holding `salt` on `client`'s device for this thread:
/// created on first use, and written (a copy queued on this thread's stream, after the
/// launches before it) only when it holds another salt. Inside a graph capture a write is
/// refused, so a capture must start with the salts its launches use already written
/// ([`set_dropout_salt`]).
pub fn dropout_salt_buffer(client: &Client, slot: u64, salt: u64) -> Handle {
    let words = [salt as u32, (salt >> 32) as u32];
    let key = (client.service_id().device, slot);
    SALTS.with(|salts| {
        let mut salts = salts.borrow_mut();
        match salts.get_mut(&key) {
            Some((handle, current)) => {
                if *current != salt {
                    client.write(
                        handle,
                        Bytes::from_bytes_vec(u32::as_bytes(&words).to_vec()),
                    );
                    *current = salt;
                }
                handle.clone()
            }
            None => {
                let handle = client.create_from_slice(u32::as_bytes(&words));
                salts.insert(key, (handle.clone(), salt));
                handle
            }
        }
    })
}

/// This thread's first salt buffer on `client`'s device as it is (created, holding 0, if
/// there is none): a binding for a launch without a draw that has no other buffer to lend.
pub(super) fn current_salt_buffer(client: &Client) -> Handle {
    let existing = SALTS.with(|salts| {
        let salts = salts.borrow();
        salts
            .get(&(client.service_id().device, 0))
            .map(|(h, _)| h.clone())
    });
    existing.unwrap_or_else(|| dropout_salt_buffer(client, 0, 0))
}

/// Writes `salt` into this thread's buffer of micro-batch slot `slot` on `client`'s device
/// (if it holds another): between the replays of a captured step, its micro-batches'.
pub fn set_dropout_salt(client: &Client, slot: u64, salt: u64) {
    dropout_salt_buffer(client, slot, salt);
}

/// The salt binding of a launch: the salt's buffer for a draw, else `unread` (a kernel
/// without a draw never reads it; binding another buffer spares the write).
pub(super) fn salt_arg(client: &Client, draw: Option<DropoutDraw>, unread: &Handle) -> BufferArg {
    match draw {
        Some(draw) => drawn_salt_arg(client, draw),
        None => arg(unread, 1),
    }
}

/// The binding of `draw`'s salt buffer (written first if it holds another salt).
pub(super) fn drawn_salt_arg(client: &Client, draw: DropoutDraw) -> BufferArg {
    arg(&dropout_salt_buffer(client, draw.salt_slot, draw.salt), 2)
}
