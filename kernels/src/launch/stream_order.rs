//! Launchers ordering CubeCL's stream against another stream's work (see
//! [`crate::stream_order`]).

use cubecl::prelude::*;
use cubecl::server::Handle;

use super::arg;
use crate::stream_order;

/// Adds one to the first counter of `flags` (a buffer of two `u32`) once the work queued
/// before on `client`'s stream has run ([`stream_order::signal`]).
pub fn signal(client: &Client, flags: &Handle) {
    stream_order::signal::launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        arg(flags, 2),
    );
}

/// Holds `client`'s stream until the second counter of `flags` has caught up with the first
/// ([`stream_order::wait_for`]); `written` (one to three buffers, each with its length in
/// elements of `F`) is what the other stream fills.
pub fn wait_for<F: Float + CubeElement>(
    client: &Client,
    flags: &Handle,
    written: &[(&Handle, usize)],
) {
    let (one, dim, flags) = (
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        arg(flags, 2),
    );
    let buffer = |(handle, len): (&Handle, usize)| arg(handle, len.max(1));
    match *written {
        [first] => stream_order::wait_for::launch::<F>(client, one, dim, flags, buffer(first)),
        [first, second] => stream_order::wait_for_both::launch::<F>(
            client,
            one,
            dim,
            flags,
            buffer(first),
            buffer(second),
        ),
        [first, second, third] => stream_order::wait_for_three::launch::<F>(
            client,
            one,
            dim,
            flags,
            buffer(first),
            buffer(second),
            buffer(third),
        ),
        _ => panic!(
            "a wait binds one to three written buffers, not {}",
            written.len()
        ),
    }
}
