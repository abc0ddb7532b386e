//! The machine's dependent-miss latency, measured in the same run as the benchmark it bounds:
//! a random pointer chase through a region far larger than the caches, one cache line per
//! step. It goes through [`Region`] like the table's reads do, on the same page size.

use std::hint::black_box;
use std::time::Instant;

use racekv_transport::Region;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Average nanoseconds per dependent load over `bytes` of memory, chasing `steps` times.
/// With `huge_pages` the region is a memfd on 2 MiB pages, like a `--huge-pages` memnode.
pub fn dependent_miss_ns(bytes: u64, steps: usize, huge_pages: bool) -> anyhow::Result<f64> {
    let bytes = bytes.next_multiple_of(2 << 20);
    let region = if huge_pages {
        let file = racekv_transport::region::shared_memory_file("baseline", bytes, true)?;
        Region::map_file(&file, bytes)?
    } else {
        Region::anonymous(bytes)?
    };
    let lines = bytes / 64;
    // Sattolo's algorithm: one random cycle through every line.
    let mut cycle: Vec<u32> = (0..lines as u32).collect();
    let mut rng = SmallRng::seed_from_u64(0x5EED);
    for i in (1..cycle.len()).rev() {
        let j = rng.random_range(0..i);
        cycle.swap(i, j);
    }
    for (line, &to) in cycle.iter().enumerate() {
        region.store_u64(line as u64 * 64, u64::from(to))?;
    }
    drop(cycle);
    let mut at = 0u64;
    for _ in 0..steps / 10 {
        at = region.load_u64(at * 64)?;
    }
    let started = Instant::now();
    for _ in 0..steps {
        at = region.load_u64(black_box(at) * 64)?;
    }
    black_box(at);
    Ok(started.elapsed().as_nanos() as f64 / steps as f64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn chases_a_full_cycle() {
        // A cache-sized buffer: the point is that it terminates with a positive figure.
        let ns = super::dependent_miss_ns(2 << 20, 100_000, false).unwrap();
        assert!(ns > 0.0);
    }
}
