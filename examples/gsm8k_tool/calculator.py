"""A calculator for GSM8K's arithmetic, as a verl function tool (rollout.multi_turn.function_tool_path):

    actor_rollout_ref.rollout.multi_turn.function_tool_path=examples/gsm8k_tool/calculator.py

It evaluates the numbers, parentheses and + - * / // % ** of an expression by walking its syntax tree:
nothing the model writes is executed as code.
"""

import ast
import operator

from verl.tools.function_tool import function_tool

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # 10 ** 10 ** 10 would take the machine's memory


def value_of(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](value_of(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = value_of(node.left), value_of(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"an exponent above {MAX_EXPONENT}")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, parentheses and + - * / // % **.

    Args:
        expression: The expression, e.g. "(12 + 30) * 4 / 7".
    """
    try:
        result = value_of(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as error:
        return f"Error: {error}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"
