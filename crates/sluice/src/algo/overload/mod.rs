//! Overload protection that tunes itself: a concurrency limit learned from latency
//! ([`gradient`]), an admission that spends it by priority with a bounded wait
//! ([`admission`]), and a simulated service to watch them on ([`sim`]).

pub mod admission;
pub mod gradient;
pub mod sim;

pub use admission::{Admission, Entry, Ticket};
pub use gradient::{Gradient, GradientError, GradientParams, Micros, Outcome};
#[cfg(test)]
mod tests;
