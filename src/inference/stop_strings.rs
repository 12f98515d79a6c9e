//! Stop strings: a continuation ends where the first of them begins (as OpenAI's `stop`).

/// Cuts `tokens` (whose text `decode` gives) before the earliest occurrence of any of `stops`:
/// the kept text, the tokens that make it up (a token the cut splits is dropped), and whether
/// a stop string was found.
pub fn cut_at_stop<E>(
    tokens: &[u32],
    stops: &[String],
    decode: impl Fn(&[u32]) -> Result<String, E>,
) -> Result<(String, Vec<u32>, bool), E> {
    let mut text = decode(tokens)?;
    let Some(cut) = stops.iter().filter_map(|s| text.find(s.as_str())).min() else {
        return Ok((text, tokens.to_vec(), false));
    };
    text.truncate(cut);
    let mut kept = tokens.to_vec();
    while !kept.is_empty() && decode(&kept)?.len() > cut {
        kept.pop();
    }
    Ok((text, kept, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_before_the_earliest_stop() {
        // One character per token.
        let decode = |t: &[u32]| -> Result<String, ()> {
            Ok(t.iter().map(|&c| char::from(c as u8)).collect())
        };
        let tokens: Vec<u32> = "hello world. next".bytes().map(u32::from).collect();
        let stops = vec![". ".to_string(), "wor".to_string()];
        let (text, kept, stopped) = cut_at_stop(&tokens, &stops, decode).unwrap();
        assert_eq!((text.as_str(), kept.len(), stopped), ("hello ", 6, true));
        let (text, kept, stopped) = cut_at_stop(&tokens, &["zzz".into()], decode).unwrap();
        assert_eq!(
            (text.as_str(), kept.len(), stopped),
            ("hello world. next", 17, false)
        );
    }
}
