//! MiniShop (work in progress).
fn main() {}
