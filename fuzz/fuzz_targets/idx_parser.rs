//! Fuzzes the `.idx` parser: any bytes, with any `.bin` size, must give a layout or an error,
//! never a panic; and an accepted layout must be safe to read everywhere it points.
#![no_main]

use ferrotron::data::IndexLayout;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    // The first 8 bytes choose the .bin size; the rest is the index.
    if input.len() < 8 {
        return;
    }
    let bin_len = u64::from_le_bytes(input[..8].try_into().unwrap()) % (1 << 20);
    let idx = &input[8..];
    if let Ok(layout) = IndexLayout::parse(idx, bin_len) {
        let itemsize = layout.dtype.itemsize() as u64;
        let mut end = 0u64;
        for i in 0..layout.sequence_count {
            let pointer = layout.sequence_pointer(idx, i);
            end = pointer + layout.sequence_length(idx, i) as u64 * itemsize;
            assert!(end <= bin_len);
        }
        assert!(layout.sequence_count == 0 || end == bin_len);
        let mut previous = 0;
        for k in 0..layout.document_index_len {
            let d = layout.document_index(idx, k);
            assert!(d >= previous && d <= layout.sequence_count);
            previous = d;
        }
    }
});
