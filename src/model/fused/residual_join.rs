//! The residual stream's gradient join, moved into the norm's backward kernel.
//!
//! In a pre-norm layer each residual tensor `x` is read twice: by the norm before the next
//! sublayer and by the residual add after it (the fused bias-dropout-add). Autodiff sums the
//! two gradients of `x` in a launch of its own (one full pass over `[tokens, hidden]`, twice
//! per layer). Here the two ops are linked instead: the norm's forward offers a
//! [`ResidualJoin`] for its input, the residual add that reads the same tensor claims it, and
//! its backward (which runs first: it is deeper in the graph) hands the residual gradient to
//! the join rather than registering it; the norm's backward kernel then adds it to dx as it
//! writes dx ([`ferrotron_kernels::rows::joined_with_residual`]: the bits of the separate add).
//!
//! Whatever the order the two backwards run in, the sum is formed once: a join whose norm ran
//! first gives the gradient back to be registered as usual. A norm whose input no residual
//! add claims (the final norm, query/key norms) is left as it was.
//!
//! Why a link between the two ops and not a look into autodiff's gradients from the norm's
//! backward: burn's `Gradients` can only be asked for a node's gradient by a call that panics
//! when there is none (`consume`), or through the input's `AutodiffTensor` (`get`, `remove`),
//! which a backward step may not keep (it holds the graph's reference count). Summing is
//! `Gradients::register`'s, in burn; the link leaves it as it is.

use std::any::Any;
use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::NodeId;
use burn::backend::tensor::FloatTensor;
use burn::backend::Backend;

/// How many offers a thread keeps unclaimed: a layer's norm is claimed before the next norm
/// offers (two more may come between, a query and a key norm).
const PENDING_OFFERS: usize = 4;

thread_local! {
    /// Offers not yet claimed, newest last: the norm's input node and its join (a
    /// `ResidualJoin<B>`, typed by the backend). Per thread, as each rank builds its graph on its
    /// own thread.
    static OFFERS: RefCell<Vec<(NodeId, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

/// Where a norm's input gradient meets the residual add's gradient of the same tensor.
pub struct ResidualJoin<B: Backend>(Arc<Mutex<Join<B>>>);

/// The join's progress through the backward pass.
enum Join<B: Backend> {
    /// Neither backward has run.
    Open,
    /// The residual add's backward ran: its gradient of the shared input, for the norm.
    Handed(FloatTensor<B>),
    /// The norm's backward ran (or took the gradient): nothing more is joined.
    Closed,
}

impl<B: Backend> Clone for ResidualJoin<B> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B: Backend> fmt::Debug for ResidualJoin<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match *self.lock() {
            Join::Open => "open",
            Join::Handed(_) => "handed",
            Join::Closed => "closed",
        };
        write!(f, "ResidualJoin({state})")
    }
}

impl<B: Backend> ResidualJoin<B> {
    /// The join a tracked norm over the tensor `input` offers to the residual add that reads
    /// the same tensor.
    pub fn offer(input: NodeId) -> Self {
        let join = Self(Arc::new(Mutex::new(Join::Open)));
        let offered = Box::new(join.clone());
        OFFERS.with_borrow_mut(|offers| {
            if offers.len() == PENDING_OFFERS {
                offers.remove(0);
            }
            offers.push((input, offered));
        });
        join
    }

    /// The join a norm over `residual` offered, for the residual add reading it (none: the
    /// add registers its gradient itself).
    pub fn claim(residual: NodeId) -> Option<Self> {
        OFFERS.with_borrow_mut(|offers| {
            let at = offers.iter().rposition(|(node, _)| *node == residual)?;
            let (_, join) = offers.remove(at);
            join.downcast::<Self>().ok().map(|join| *join)
        })
    }

    /// The residual add's backward: hands over its gradient of the shared input, or gives it
    /// back (to be registered as usual) when the norm's backward has already run.
    pub fn hand_over(&self, grad: FloatTensor<B>) -> Option<FloatTensor<B>> {
        let mut join = self.lock();
        match *join {
            Join::Open => {
                *join = Join::Handed(grad);
                None
            }
            _ => Some(grad),
        }
    }

    /// The norm's backward: the residual add's gradient of its input, if handed over, for the
    /// kernel to add to dx. Closes the join either way.
    pub fn take(&self) -> Option<FloatTensor<B>> {
        match std::mem::replace(&mut *self.lock(), Join::Closed) {
            Join::Handed(grad) => Some(grad),
            _ => None,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Join<B>> {
        // A poisoned join only means a backward panicked: its state is still whole.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
