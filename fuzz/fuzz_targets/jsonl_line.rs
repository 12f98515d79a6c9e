//! Fuzzes the JSONL line reader and the GPT-2 pre-tokenizer: no input may panic, and the
//! pre-tokens of any text must cover it exactly.
#![no_main]

use ferrotron::preprocess::jsonl::parse_line;
use ferrotron::tokenizer::Gpt2PreTokens;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let keys = vec!["text".to_owned(), "title".to_owned()];
    let _ = parse_line(input, &keys);
    if let Ok(text) = std::str::from_utf8(input) {
        let joined: String = Gpt2PreTokens::new(text).collect();
        assert_eq!(joined, text);
    }
});
