//! The micro-batch's dropout salt in device memory: a draw's key is the constant its launch
//! carries XOR this salt ([`crate::dropout::salted`]), so a launch recorded in a captured graph
//! draws the masks of whichever micro-batch's salt is written here before the replay, while
//! the eager step writes it when a launch needs another micro-batch's.

use std::cell::RefCell;
use std::collections::HashMap;

use cubecl::bytes::Bytes;
use cubecl::device::DeviceId;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arg;
use super::dropout::DropoutDraw;

thread_local! {
    /// Per device this thread launches on: the salt's buffer (two `u32`, low word first) and
    /// the value last written to it. Per thread because each thread has its own CubeCL stream
    /// (ranks as threads of one process each draw their own micro-batches), and a write is
    /// ordered only on its own stream.
    static SALTS: RefCell<HashMap<DeviceId, (Handle, u64)>> = RefCell::new(HashMap::new());
}

/// The buffer holding `salt` on `client`'s device for this thread: created on first use, and
/// written (a copy queued on this thread's stream, after the launches before it) only when
/// it holds another salt. Inside a graph capture a write is refused, so a capture must start
/// with the salt its launches use already written ([`set_dropout_salt`]).
pub fn dropout_salt_buffer(client: &Client, salt: u64) -> Handle {
    let words = [salt as u32, (salt >> 32) as u32];
    SALTS.with(|salts| {
        let mut salts = salts.borrow_mut();
        match salts.get_mut(&client.service_id().device) {
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
                salts.insert(client.service_id().device, (handle.clone(), salt));
                handle
            }
        }
    })
}

/// This thread's salt buffer on `client`'s device as it is (created, holding 0, if there is
/// none): a binding for a launch without a draw that has no other buffer to lend.
pub(super) fn current_salt_buffer(client: &Client) -> Handle {
    let existing = SALTS.with(|salts| {
        let salts = salts.borrow();
        salts
            .get(&client.service_id().device)
            .map(|(h, _)| h.clone())
    });
    existing.unwrap_or_else(|| dropout_salt_buffer(client, 0))
}

/// Writes `salt` into this thread's salt buffer on `client`'s device (if it holds another):
/// between the replays of a captured step, the next micro-batch's.
pub fn set_dropout_salt(client: &Client, salt: u64) {
    dropout_salt_buffer(client, salt);
}

/// The salt binding of a launch: the salt's buffer for a draw, else `unread` (a kernel
/// without a draw never reads it; binding another buffer spares the write).
pub(super) fn salt_arg(client: &Client, draw: Option<DropoutDraw>, unread: &Handle) -> BufferArg {
    match draw {
        Some(draw) => arg(&dropout_salt_buffer(client, draw.salt), 2),
        None => arg(unread, 1),
    }
}
