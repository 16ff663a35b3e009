//! GPT-2's tokenizer (round trips, GPT-2's own encodings) and llm.c token shards (round
//! trip, and the errors for damaged files).

use kiln::text::{read_shard, write_shard, Gpt2Tokenizer};

#[test]
fn gpt2_tokens_round_trip_and_match_gpt2s_encodings() -> kiln::Result<()> {
    let tok = Gpt2Tokenizer::new()?;
    // GPT-2's well-known encodings.
    assert_eq!(tok.encode("Hello world"), [15496, 995]);
    assert_eq!(tok.encode_with_eot("<|endoftext|>"), [Gpt2Tokenizer::EOT]);
    // As ordinary text, the special token's spelling is several tokens.
    assert!(tok.encode("<|endoftext|>").len() > 1);
    for text in ["Kiln trains models.", "Größe, naïve café — 東京 и Москва 🙂", "  spaces\n\ttabs\r\n", ""] {
        assert_eq!(tok.decode(&tok.encode(text))?, text);
    }
    let err = tok.decode(&[15496, 60000]).unwrap_err().to_string();
    assert!(err.contains("60000") && err.contains("position 1"), "{err}");
    Ok(())
}

#[test]
fn shards_round_trip_and_damaged_ones_are_refused() -> kiln::Result<()> {
    let dir = std::env::temp_dir().join(format!("kiln-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("train_000.bin");
    let tokens: Vec<u16> = (0..1000u32).map(|i| (i * 7919 % 50257) as u16).collect();
    write_shard(&path, &tokens)?;
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1024 + 2000);
    assert_eq!(read_shard(&path)?, tokens);
    // A cut file, a wrong magic, a file too short for the header.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let err = read_shard(&path).unwrap_err().to_string();
    assert!(err.contains("train_000.bin") && err.contains("1000 tokens") && err.contains("1997 bytes"), "{err}");
    let mut wrong = bytes.clone();
    wrong[0] = 0;
    std::fs::write(&path, &wrong).unwrap();
    assert!(read_shard(&path).unwrap_err().to_string().contains("not an llm.c token shard"));
    std::fs::write(&path, &bytes[..100]).unwrap();
    assert!(read_shard(&path).unwrap_err().to_string().contains("header"));
    assert!(read_shard(&dir.join("missing.bin")).unwrap_err().to_string().contains("missing.bin"));
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
