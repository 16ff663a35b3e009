//! A training run's log: a CSV of step, train loss, validation loss, learning rate and
//! tokens/s, and a PNG of the train and validation loss curves (drawn with `plotters`),
//! both rewritten as the run goes so that they can be watched.

use kiln_tensor::{Error, Result};
use plotters::prelude::*;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One logged step; `val_loss` on the steps that evaluated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogRow {
    pub step: usize,
    pub train_loss: f64,
    pub val_loss: Option<f64>,
    pub lr: f64,
    pub tokens_per_s: f64,
}

/// The log of one run: `<dir>/metrics.csv` and `<dir>/loss.png`.
///
/// ```
/// use kiln::metrics::{LogRow, TrainLog};
/// let dir = std::env::temp_dir().join(format!("kiln-doc-log-{}", std::process::id()));
/// let mut log = TrainLog::create(&dir)?;
/// for step in 0..3 {
///     let val_loss = (step == 2).then_some(3.5);
///     log.push(LogRow { step, train_loss: 4.0 - step as f64 * 0.2, val_loss, lr: 1e-3, tokens_per_s: 1e4 })?;
/// }
/// log.plot("example")?; // loss.png
/// assert_eq!(std::fs::read_to_string(&log.csv).unwrap().lines().count(), 4);
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct TrainLog {
    pub csv: PathBuf,
    pub png: PathBuf,
    rows: Vec<LogRow>,
}

const HEADER: &str = "step,train_loss,val_loss,lr,tokens_per_s";
const FONT: &[u8] = include_bytes!("../data/DejaVuSans-ascii.ttf");

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {e}", path.display()))
}

impl TrainLog {
    /// A new log in `dir` (created if missing); the CSV starts with its header.
    pub fn create(dir: &Path) -> Result<TrainLog> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let log = TrainLog { csv: dir.join("metrics.csv"), png: dir.join("loss.png"), rows: Vec::new() };
        std::fs::write(&log.csv, format!("{HEADER}\n")).map_err(|e| io(&log.csv, e))?;
        Ok(log)
    }

    /// The log in `dir` continued from its CSV (a resumed run): the rows before `step` are
    /// kept, later ones (written after the checkpoint it resumes from) dropped.
    pub fn resume(dir: &Path, step: usize) -> Result<TrainLog> {
        let csv = dir.join("metrics.csv");
        let text = match std::fs::read_to_string(&csv) {
            Ok(t) => t,
            Err(_) => return TrainLog::create(dir),
        };
        let mut log = TrainLog::create(dir)?;
        for (i, line) in text.lines().enumerate().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            let num = |k: usize| f.get(k).and_then(|v| v.parse::<f64>().ok());
            let (Some(s), Some(train_loss), Some(lr), Some(tokens_per_s)) = (num(0), num(1), num(3), num(4)) else {
                return Err(Error::Format { what: csv.display().to_string(), msg: format!("line {}: '{line}' is not a log row", i + 1) });
            };
            if (s as usize) < step {
                log.push(LogRow { step: s as usize, train_loss, val_loss: num(2), lr, tokens_per_s })?;
            }
        }
        Ok(log)
    }

    pub fn rows(&self) -> &[LogRow] {
        &self.rows
    }

    /// Appends a row to the CSV.
    pub fn push(&mut self, r: LogRow) -> Result<()> {
        let val = r.val_loss.map(|v| format!("{v:.6}")).unwrap_or_default();
        let line = format!("{},{:.6},{val},{:.6e},{:.1}\n", r.step, r.train_loss, r.lr, r.tokens_per_s);
        let mut f = std::fs::OpenOptions::new().append(true).open(&self.csv).map_err(|e| io(&self.csv, e))?;
        f.write_all(line.as_bytes()).map_err(|e| io(&self.csv, e))?;
        self.rows.push(r);
        Ok(())
    }

    /// Draws the loss curves into the PNG: the train loss of every row, the validation
    /// loss where it was measured.
    pub fn plot(&self, title: &str) -> Result<()> {
        // Registering the same font again is harmless.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
        let err = |e: &dyn std::fmt::Display| io(&self.png, e);
        let root = BitMapBackend::new(&self.png, (900, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let train: Vec<(f64, f64)> = self.rows.iter().map(|r| (r.step as f64, r.train_loss)).filter(|p| p.1.is_finite()).collect();
        let val: Vec<(f64, f64)> =
            self.rows.iter().filter_map(|r| Some((r.step as f64, r.val_loss?))).filter(|p| p.1.is_finite()).collect();
        let all = train.iter().chain(&val);
        let (x1, mut y0, mut y1) = all.clone().fold((1.0f64, f64::MAX, f64::MIN), |(x, lo, hi), p| (x.max(p.0), lo.min(p.1), hi.max(p.1)));
        if y0 > y1 {
            (y0, y1) = (0.0, 1.0);
        }
        let pad = ((y1 - y0) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x1, (y0 - pad)..(y1 + pad))
            .map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("step").y_desc("loss (nats)").label_style(("sans-serif", 14)).draw().map_err(|e| err(&e))?;
        let blue = RGBColor(31, 119, 180);
        let orange = RGBColor(255, 127, 14);
        chart
            .draw_series(LineSeries::new(train, blue.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("train")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], blue.stroke_width(2)));
        chart
            .draw_series(LineSeries::new(val.clone(), orange.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("validation")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], orange.stroke_width(2)));
        chart.draw_series(val.iter().map(|&p| Circle::new(p, 4, orange.filled()))).map_err(|e| err(&e))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))
    }
}
