"""Similarity of generated responses to reference texts: corpus BLEU (sacrebleu) and ROUGE-L
(rouge-score), the implementations papers report, on a 0-1 scale."""

from __future__ import annotations


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU of ``hypotheses`` against one reference each, divided by 100."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hypotheses, [references]).score / 100.0


def rouge_l(hypotheses: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F-measure."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    scores = [scorer.score(ref, hyp)["rougeL"].fmeasure for hyp, ref in zip(hypotheses, references)]
    return sum(scores) / max(len(scores), 1)
