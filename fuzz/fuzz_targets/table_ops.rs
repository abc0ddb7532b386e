//! Fuzzes sequences of table operations against a `HashMap` model, in the manner of redb's
//! `fuzz_redb`: the input decodes (`racekv_hashing::testing::model::decode`) to a table shape
//! and steps of gets, puts of every mode and expiry (values up to 2 MiB, in extents past a
//! block), deletes, compare-and-swaps, expiry updates and FLUSHALLs on up to three clients,
//! some of whose requests the input has lost before or after they ran. The driver checks
//! every result against the model and, now and then and at the end, the whole table: each
//! key once, exactly the model's, and no extent leaked or freed early.
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_hashing::testing::model;

fuzz_target!(|data: &[u8]| {
    let (config, steps) = model::decode(data);
    model::run(&config, &steps);
});
