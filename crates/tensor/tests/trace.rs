//! The trace hook: a recording tracer sees every op of a small expression, in order, with
//! its inputs and outputs, and is told about host reads.

use kiln_tensor::{set_tracer, BinaryOp, DType, Device, Op, ReduceOp, Result, Tensor, TensorId, Tracer, UnaryOp};
use std::cell::RefCell;
use std::rc::Rc;

#[derive(Default)]
struct Recorder {
    ops: RefCell<Vec<(Op, Vec<TensorId>, TensorId)>>,
    reads: RefCell<Vec<&'static str>>,
    refuse_reads: bool,
}

impl Tracer for Recorder {
    fn record(&self, op: &Op, inputs: &[&Tensor], output: &Tensor) {
        self.ops.borrow_mut().push((op.clone(), inputs.iter().map(|t| t.id()).collect(), output.id()));
    }
    fn host_read(&self, what: &'static str, _t: &Tensor) -> Result<()> {
        self.reads.borrow_mut().push(what);
        if self.refuse_reads {
            return Err(kiln_tensor::Error::GraphBreak(format!("{what} inside a traced step")));
        }
        Ok(())
    }
}

#[test]
fn a_recording_tracer_sees_the_op_list() -> Result<()> {
    let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, -4.0], &[2, 2], Device::Cpu)?;
    let w = Tensor::from_slice(&[0.5f32, 0.5], &[2], Device::Cpu)?;
    let rec = Rc::new(Recorder::default());
    set_tracer(Some(rec.clone()));
    // relu(x * w).sum(1) then an in-place update of w.
    let y = x.mul(&w)?.relu()?.sum(&[1], false)?;
    w.add_scalar_(1.0)?;
    set_tracer(None);
    let ops = rec.ops.borrow();
    let names: Vec<&Op> = ops.iter().map(|(o, _, _)| o).collect();
    assert_eq!(
        names,
        vec![
            &Op::Binary(BinaryOp::Mul),
            &Op::Unary(UnaryOp::Relu),
            &Op::Reduce { op: ReduceOp::Sum, dims: vec![1], keepdim: false },
            &Op::UpdateScalar(BinaryOp::Add, 1.0),
        ]
    );
    // Each op's inputs are the previous op's output; the update's output is w itself.
    assert_eq!(ops[0].1, vec![x.id(), w.id()]);
    assert_eq!(ops[1].1, vec![ops[0].2]);
    assert_eq!(ops[2].2, y.id());
    assert_eq!((ops[3].1.clone(), ops[3].2), (vec![w.id()], w.id()));
    // Ops outside the trace are not recorded; the values were computed all the same.
    assert_eq!(y.to_vec::<f32>()?, vec![0.5, 1.5]);
    assert_eq!(rec.ops.borrow().len(), 4);
    Ok(())
}

#[test]
fn host_reads_reach_the_tracer_which_may_refuse_them() -> Result<()> {
    let x = Tensor::ones(&[2], DType::F32, Device::Cpu)?;
    let rec = Rc::new(Recorder { refuse_reads: true, ..Default::default() });
    set_tracer(Some(rec.clone()));
    let r = x.sum_all()?.item();
    let printed = format!("{x}");
    set_tracer(None);
    assert!(r.unwrap_err().to_string().contains("graph break: to_vec inside a traced step"));
    assert!(printed.contains("graph break"), "{printed}");
    assert_eq!(*rec.reads.borrow(), vec!["to_vec", "to_vec"]);
    Ok(())
}
