pub mod listen;
pub mod rlqs;
pub mod rls;
