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

#[test]
fn windows_cover_the_data_and_keep_to_their_split() -> kiln::Result<()> {
    use kiln::text::{TokenDataset, TokenSplit};
    use rand::SeedableRng;
    // Train tokens 0..400 in two shards (one memory-mapped file, one too short to matter
    // for its length but still sampled), validation 1000..1100.
    let dir = std::env::temp_dir().join(format!("kiln-windows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_shard(&dir.join("train_000.bin"), &(0..300).collect::<Vec<u16>>())?;
    write_shard(&dir.join("train_001.bin"), &(300..400).collect::<Vec<u16>>())?;
    write_shard(&dir.join("val_000.bin"), &(1000..1100).collect::<Vec<u16>>())?;
    let data = TokenDataset::open_dir(&dir)?;
    assert_eq!((data.train.len(), data.val.len()), (400, 100));
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut seen = vec![false; 400];
    for _ in 0..200 {
        let (x, y) = data.train.batch(4, 16, 2000, &mut rng, kiln::Device::Cpu)?;
        let (x, y) = (x.to_vec::<i64>()?, y.to_vec::<i64>()?);
        for (xr, yr) in x.chunks(16).zip(y.chunks(16)) {
            // A window: consecutive tokens within one shard, the targets shifted by one.
            assert!(xr.windows(2).all(|w| w[1] == w[0] + 1), "{xr:?}");
            assert_eq!(yr[0], xr[0] + 1);
            assert!((xr[0] < 300) == (yr[15] < 300), "a window crosses shards: {xr:?}");
            xr.iter().chain(yr).for_each(|&t| seen[t as usize] = true);
        }
        let (vx, _) = data.val.batch(2, 16, 2000, &mut rng, kiln::Device::Cpu)?;
        assert!(vx.to_vec::<i64>()?.iter().all(|&t| (1000..1100).contains(&t)));
    }
    assert!(seen.iter().all(|&s| s), "windows missed tokens {:?}", seen.iter().positions_false());
    // Errors name the file and position.
    let e = data.train.batch(1, 16, 100, &mut rng, kiln::Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("train_00") && e.contains("outside the model's vocabulary of 100"), "{e}");
    let e = data.val.batch(1, 200, 2000, &mut rng, kiln::Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("val_000.bin") && e.contains("window of 201 tokens"), "{e}");
    std::fs::write(dir.join("val_001.bin"), [0u8; 1025]).unwrap();
    let e = TokenDataset::open_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("val_001.bin"), "{e}");
    // Text in memory: the last tenth held out.
    let text = "Kiln trains language models on text. ".repeat(50);
    let d = TokenDataset::from_text("repeat", &text, 0.1)?;
    assert_eq!(d.train.len() + d.val.len(), Gpt2Tokenizer::new()?.encode(&text).len());
    assert_eq!(d.val.len(), (d.train.len() + d.val.len()) / 10);
    assert!(TokenDataset::from_text("empty", "  \n", 0.1).is_err());
    let split = TokenSplit::from_tokens("three", vec![1, 2, 3]);
    assert_eq!(split.batch(1, 2, 10, &mut rng, kiln::Device::Cpu)?.1.to_vec::<i64>()?, vec![2, 3]);
    Ok(())
}

trait PositionsFalse {
    fn positions_false(self) -> Vec<usize>;
}

impl<'a, I: Iterator<Item = &'a bool>> PositionsFalse for I {
    fn positions_false(self) -> Vec<usize> {
        self.enumerate().filter(|(_, &s)| !s).map(|(i, _)| i).collect()
    }
}

#[test]
fn the_training_log_writes_its_csv_and_png() -> kiln::Result<()> {
    use kiln::metrics::{LogRow, TrainLog};
    let dir = std::env::temp_dir().join(format!("kiln-log-{}", std::process::id()));
    let mut log = TrainLog::create(&dir)?;
    for step in 0..30 {
        let val_loss = (step % 10 == 0).then_some(5.0 - step as f64 * 0.05);
        log.push(LogRow { step, train_loss: 5.0 - step as f64 * 0.1, val_loss, lr: 1e-3, tokens_per_s: 1234.5 })?;
    }
    log.plot("test run")?;
    let csv = std::fs::read_to_string(&log.csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 31);
    assert_eq!(lines[0], "step,train_loss,val_loss,lr,tokens_per_s");
    assert_eq!(lines[1], "0,5.000000,5.000000,1.000000e-3,1234.5");
    assert_eq!(lines[2], "1,4.900000,,1.000000e-3,1234.5");
    let png = std::fs::read(&log.png).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // A resumed run keeps the rows before its checkpoint's step.
    let resumed = TrainLog::resume(&dir, 12)?;
    assert_eq!(resumed.rows(), &log.rows()[..12]);
    assert_eq!(std::fs::read_to_string(&resumed.csv).unwrap().lines().count(), 13);
    // 900 x 540 pixels (the IHDR chunk's width and height).
    assert_eq!((u32::from_be_bytes(png[16..20].try_into().unwrap()), u32::from_be_bytes(png[20..24].try_into().unwrap())), (900, 540));
    Ok(())
}

#[test]
fn nanogpt_bare_token_files_are_read_too() -> kiln::Result<()> {
    use kiln::text::TokenDataset;
    use rand::SeedableRng;
    let dir = std::env::temp_dir().join(format!("kiln-bare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bare = |range: std::ops::Range<u16>| range.flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>();
    std::fs::write(dir.join("train.bin"), bare(0..500)).unwrap();
    std::fs::write(dir.join("val.bin"), bare(500..600)).unwrap();
    let data = TokenDataset::open_dir(&dir)?;
    assert_eq!((data.train.len(), data.val.len()), (500, 100));
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (x, y) = data.val.batch(3, 8, 1000, &mut rng, kiln::Device::Cpu)?;
    let (x, y) = (x.to_vec::<i64>()?, y.to_vec::<i64>()?);
    assert!(x.iter().all(|t| (500..600).contains(t)));
    assert!(x.iter().zip(&y).all(|(a, b)| b - a == 1));
    std::fs::write(dir.join("val.bin"), [1u8; 201]).unwrap();
    let e = TokenDataset::open_dir(&dir).err().unwrap().to_string();
    assert!(e.contains("val.bin") && e.contains("201 bytes are not a whole number"), "{e}");
    Ok(())
}
