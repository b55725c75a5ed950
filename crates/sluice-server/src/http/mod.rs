pub mod admin;
pub mod admin_import;
pub mod api;
pub mod envoy;
pub mod json;
pub mod listen;
pub mod ui;

pub use api::*;
