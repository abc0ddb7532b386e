//! A bank for transaction tests: accounts in groups, transfers within a group (so each
//! group's total is fixed), and snapshots of a range of accounts. The client's embedded
//! tests and the computenode's attached and remote ones include this file by path.

use racekv_client::{Client, ClientError};

/// A balance as stored (an absent account holds 0).
pub fn number(value: Option<Vec<u8>>) -> i64 {
    value.map_or(0, |v| String::from_utf8(v).unwrap().parse().unwrap())
}

/// Account `i`'s key.
pub fn account(i: usize) -> Vec<u8> {
    format!("account-{i}").into_bytes()
}

/// The next number of a splitmix64 sequence (seeded, reproducible).
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Accounts are in groups of this many; transfers stay within a group, so each group's
/// total is fixed (and a snapshot of one group is a short read, which busy writers do not
/// starve).
pub const GROUP: usize = 4;

/// Moves a pseudo-random amount between two pseudo-random accounts of one group.
pub fn transfer(client: &Client, accounts: usize, seed: u64) -> Result<(), ClientError> {
    let group = (seed % (accounts / GROUP) as u64) as usize * GROUP;
    let from = group + ((seed >> 8) % GROUP as u64) as usize;
    let to = group + ((seed >> 16) % GROUP as u64) as usize;
    let amount = ((seed >> 32) % 50) as i64;
    client.transaction(|tx| {
        let a = number(tx.get(&account(from))?);
        let b = number(tx.get(&account(to))?);
        if from == to {
            return Ok(());
        }
        tx.put(&account(from), (a - amount).to_string().as_bytes());
        tx.put(&account(to), (b + amount).to_string().as_bytes());
        Ok(())
    })
}

/// The sum of accounts `range`, read in one transaction (a snapshot).
pub fn total(client: &Client, range: std::ops::Range<usize>) -> Result<i64, ClientError> {
    client.transaction(|tx| {
        let mut sum = 0;
        for i in range.clone() {
            sum += number(tx.get(&account(i))?);
        }
        Ok(sum)
    })
}
