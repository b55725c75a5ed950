//! A rate limiter in one process, in ten lines: 3 requests a minute per user.
//!
//! `cargo run -p sluice --example in_process`

use sluice::{DomainBuilder, Limiter, Request, RulesBuilder};
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rules = RulesBuilder::new()
        .domain(
            DomainBuilder::new("api")
                .rule([("user", None)], |r| r.fixed_window("per_minute", 3, Duration::from_secs(60))),
        )
        .build()?;
    let limiter = Limiter::in_memory(rules);
    for i in 1..=4 {
        let verdict = limiter.check(&Request::new("api").descriptor([("user", "alice")])).await?;
        let d = verdict.binding().expect("a rule matched").decision;
        println!("request {i}: {:?}, {} left, resets at {} ms", verdict.outcome, d.remaining, d.reset_at);
    }
    Ok(())
}
